"""A model's anatomy as the planner needs it: every parameter's shape and how tensor parallelism splits it.

Shapes come from the real Hugging Face model built on the meta device (no weights, no memory); the
tensor-parallel split of each parameter comes from the adapter's roles, as meshtron's TP code uses them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshtron.config import LoraConfig, ModelConfig
from meshtron.metrics.flops import lora_flops_change
from meshtron.models.adapter import canonical_name
from meshtron.models.lora import LORA_A, add_lora, is_lora_parameter
from meshtron.models.moe import experts_per_token, is_moe, num_experts
from meshtron.train.optim.muon import muon_parameters

NORM_ROLES = ("norm", "head_norm", "gathered_norm")
"""Roles of the parameters no tensor-parallel rank splits: norms (and the biases that share their role)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape and the dim tensor parallelism splits (None: every tp rank holds it whole)."""

    name: str
    shape: tuple[int, ...]
    role: str
    muon: bool = False
    """Stepped by Muon under ``optimizer.name=muon`` (a block matrix: one momentum buffer instead of two moments)."""
    trained: bool = True
    """Takes gradients and optimizer state (False: a base weight frozen by LoRA, ``[lora]``)."""

    def tp_dim(self, tp: int, num_kv_heads: int) -> int | None:
        if tp == 1 or self.role in (*NORM_ROLES, "replicated", "latent_rope"):
            return None
        if self.role == "kv_colwise" and num_kv_heads < tp:
            return None  # replicated KV projection
        if self.role == "rowwise":
            return 1 if len(self.shape) == 2 else None  # a row-parallel bias is replicated
        return 0  # colwise, kv_colwise, embedding, head (and their biases)

    @property
    def expert(self) -> bool:
        """A routed experts' fused 3-D parameter (``[E, ...]``, inside the replicated sparse block), or gpt-oss's
        experts' biases (``[E, 2I]``, ``[E, H]``: split over experts with them)."""
        return self.role == "replicated" and (
            len(self.shape) == 3 or (".experts." in self.name and len(self.shape) == 2)
        )

    def local_numel(self, tp: int, fsdp: int, num_kv_heads: int, ep: int = 1) -> int:
        """Elements the largest holder keeps: its tp split, then FSDP's dim-0 split (rank 0 gets the ceiling
        of both: a vocabulary tp does not divide is split unevenly, as ``torch.chunk`` does). Under expert
        parallelism (``ep`` > 1) an expert parameter keeps ``E / ep`` experts, which FSDP splits over the
        ``efsdp = fsdp / ep`` ranks holding the same experts (``fsdp`` 1: unsharded, the ``E / ep`` whole)."""
        shape = list(self.shape)
        dim = self.tp_dim(tp, num_kv_heads)
        if dim is not None:
            shape[dim] = -(-shape[dim] // tp)
        if ep > 1 and self.expert:
            shape[0] = shape[0] // ep
            fsdp = max(1, fsdp // ep)
        shape[0] = -(-shape[0] // fsdp)
        return math.prod(shape)


@dataclass(frozen=True)
class ModelShape:
    """The parameters of one decoder block (all blocks are alike) and of the parts around them."""

    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    block: tuple[ParamSpec, ...]
    embedding: tuple[ParamSpec, ...]
    final: tuple[ParamSpec, ...]
    """The final norm and (untied) head."""
    head_norms: bool
    """Per-head q/k norms inside attention (Qwen3)."""
    residual_norms: int = 2
    """Norms on the residual stream per block (4 in Gemma: before and after attention and MLP)."""
    eager_attention: bool = False
    """Attention by transformers' eager path (``model.attn_implementation=eager``): it keeps the scores."""
    attention_softcap: bool = False
    """Soft-capped attention scores (Gemma 2): one more kept copy of the scores under eager attention."""
    logit_softcap: bool = False
    """Soft-capped final logits (Gemma 2): the loss keeps the capped fp32 logits too."""
    gated_mlp: bool = True
    """A gated MLP (gate and up projections); False: two matrices around the activation (StarCoder2)."""
    experts: int = 0
    """Routed experts per MoE block (0: a dense model; meshtron.models.moe)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate: int = 0
    """Intermediate size of one routed expert."""
    shared_expert_intermediate: int = 0
    """Intermediate size of the dense shared expert beside the routed ones (Qwen2-MoE; 0: none)."""
    lora_flops_per_token: float = 0.0
    """What LoRA changes in the training FLOPs per token (meshtron.metrics.flops.lora_flops_change; 0 without)."""
    value_head_dim: int = 0
    """Width of a value head when it differs from ``head_dim`` (DeepSeek-V3's latent attention; 0: ``head_dim``)."""
    q_latent: int = 0
    """Multi-head latent attention (DeepSeek-V3): the query latent's width (``q_lora_rank``; 0 without)."""
    kv_latent: int = 0
    """Multi-head latent attention: the key-value latent's width (``kv_lora_rank``; 0: no latent attention)."""
    nope_dim: int = 0
    """Multi-head latent attention: the part of a key head the key-value latent gives (``qk_nope_head_dim``)."""
    dense_layers: int = 0
    """The first layers of an MoE model whose MLP is dense (DeepSeek-V3's ``first_k_dense_replace``): they have
    ``dense_block``'s parameters instead of ``block``'s."""
    dense_block: tuple[ParamSpec, ...] = ()

    def dense_layers_of(self, layers: int, first: bool) -> int:
        """How many of a stage's ``layers`` blocks are dense: the stage holding the model's first blocks (``first``,
        a pipeline's first stage) holds the dense layers."""
        return min(layers, self.dense_layers) if first else 0

    def blocks_numel(self, layers: int, first: bool, numel) -> int:
        """``numel(specs)`` summed over ``layers`` consecutive blocks, the first of the model when ``first``."""
        dense = self.dense_layers_of(layers, first)
        return (layers - dense) * numel(self.block) + (dense * numel(self.dense_block) if dense else 0)

    @property
    def frozen_norms(self) -> bool:
        """The norms' weights are frozen (LoRA): a norm then keeps no normalized output for its weight's gradient."""
        return any(not p.trained for p in self.block if p.role in NORM_ROLES)

    @property
    def adapter_ranks(self) -> int:
        """Sum of the ranks of a block's linear adapters: each keeps its rank-sized output (A x) per token."""
        return sum(p.shape[0] for p in self.block if f".{LORA_A}." in p.name and len(p.shape) == 2)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses: the routed experts' only ``experts_per_token / experts`` of them."""
        if not self.experts:
            return self.total_params
        expert_params = sum(math.prod(p.shape) for p in self.block if p.expert)
        moe_layers = self.layers - self.dense_layers
        return self.total_params - moe_layers * expert_params * (self.experts - self.experts_per_token) // self.experts

    @property
    def total_params(self) -> int:
        outer = sum(math.prod(p.shape) for p in self.embedding + self.final)
        return self.blocks_numel(self.layers, True, lambda specs: sum(math.prod(p.shape) for p in specs)) + outer

    @classmethod
    def from_hf_config(
        cls, hf_config, model_cfg: ModelConfig | None = None, lora: LoraConfig | None = None
    ) -> "ModelShape":
        """``lora``: a LoRA run's settings (its adapters are parameters too, and only they and what else trains
        take gradients and optimizer state)."""
        from meshtron.models.build import build_meta_model
        from meshtron.models.families import family_of, resolve_attn_implementation

        model_cfg = model_cfg or ModelConfig()
        # A family that runs only with eager attention (Gemma 2) is planned with it whatever the setting says.
        eager_only = family_of(hf_config).eager_only
        attn_implementation = (
            "eager" if eager_only else resolve_attn_implementation(model_cfg.attn_implementation, hf_config)
        )
        model_cfg = dataclasses.replace(model_cfg, attn_implementation=attn_implementation)
        model, adapter = build_meta_model(hf_config, model_cfg)
        if lora is not None and lora.enabled:
            add_lora(model, adapter, lora)
        all_blocks = adapter.named_blocks(model)
        dense_layers = _dense_layers(hf_config, all_blocks)
        blocks = all_blocks[dense_layers:]  # the MoE blocks of a model whose first layers are dense
        roles = adapter.block_tp_roles(blocks[0][1])
        # Inside a replicated block (a sparse MoE block: router, 3-D experts, shared expert) every tp rank holds
        # every parameter whole; FSDP still splits dim 0 (the experts of [E, ...] parameters).
        replicated = tuple(path + "." for path, role in roles.items() if role == "replicated_block")
        block_specs = _block_specs(blocks[0][1], roles, replicated)
        dense_specs: tuple[ParamSpec, ...] = ()
        if dense_layers:
            dense_specs = _block_specs(all_blocks[0][1], adapter.block_tp_roles(all_blocks[0][1]), ())
        shapes = {tuple(sorted((n, tuple(p.shape)) for n, p in block.named_parameters())) for _, block in blocks}
        if len(shapes) != 1:
            raise ValueError(
                f"model family '{adapter.family}': decoder blocks differ in shape; the planner needs alike blocks"
            )
        top_roles = adapter.top_tp_roles(model)
        embedding: list[ParamSpec] = []
        final: list[ParamSpec] = []
        for raw_name, param in model.named_parameters():  # tied parameters are listed once
            name = canonical_name(raw_name)
            if ".layers." in name:
                continue
            module = name.rsplit(".", 1)[0]
            spec = ParamSpec(name, tuple(param.shape), top_roles.get(module, "norm"), trained=param.requires_grad)
            (embedding if spec.role == "embedding" else final).append(spec)
        shape = adapter.attention_shape(hf_config)
        return cls(
            family=adapter.family,
            hidden=hf_config.hidden_size,
            intermediate=hf_config.intermediate_size,
            layers=hf_config.num_hidden_layers,
            heads=shape.num_heads,
            kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            vocab=hf_config.vocab_size,
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            block=block_specs,
            embedding=tuple(embedding),
            final=tuple(final),
            head_norms=any(r in ("head_norm", "gathered_norm") for r in roles.values()),
            residual_norms=sum(r == "norm" for r in roles.values()),
            eager_attention=model_cfg.attn_implementation == "eager",
            attention_softcap=bool(getattr(hf_config, "attn_logit_softcapping", None)),
            logit_softcap=bool(adapter.logit_softcap(model)),
            gated_mlp=any(
                name.endswith(("mlp.gate_proj", "mlp.gate_up_proj")) for name, _ in blocks[0][1].named_modules()
            )
            or bool(replicated),  # experts are gated MLPs
            experts=num_experts(hf_config),
            experts_per_token=experts_per_token(hf_config) if is_moe(hf_config) else 0,
            moe_intermediate=_moe_intermediate(hf_config),
            shared_expert_intermediate=_shared_expert_intermediate(hf_config),
            lora_flops_per_token=lora_flops_change(model, adapter, hf_config) if lora and lora.enabled else 0.0,
            dense_layers=dense_layers,
            dense_block=dense_specs,
            value_head_dim=shape.v_dim,
            q_latent=int(getattr(hf_config, "q_lora_rank", None) or 0),
            kv_latent=int(getattr(hf_config, "kv_lora_rank", None) or 0),
            nope_dim=int(getattr(hf_config, "qk_nope_head_dim", None) or 0),
        )


def _block_specs(block, roles: dict[str, str], replicated: tuple[str, ...]) -> tuple[ParamSpec, ...]:
    """The ParamSpecs of one decoder block's parameters, by their tensor-parallel roles."""
    specs = []
    muon = {id(p) for p in muon_parameters([block], _SingleBlock())}
    for name, param in block.named_parameters():
        module = name.rsplit(".", 1)[0]
        role = "replicated" if name.startswith(replicated) else roles.get(module, "norm")
        if is_lora_parameter(name):  # split as meshtron.distributed.lora_tensor_parallel splits it
            role = _lora_role(name, roles.get(module.rsplit(".", 1)[0], "replicated"))
        specs.append(ParamSpec(name, tuple(param.shape), role, id(param) in muon, param.requires_grad))
    return tuple(specs)


def _dense_layers(hf_config, blocks) -> int:
    """How many first layers of an MoE model have a dense MLP (DeepSeek-V3's ``first_k_dense_replace``)."""
    if not is_moe(hf_config):
        return 0
    return min(int(getattr(hf_config, "first_k_dense_replace", 0) or 0), len(blocks) - 1)


def _lora_role(name: str, projection_role: str) -> str:
    """The tensor-parallel role of an adapter weight: ``A`` of a row-parallel projection is split like it (by
    columns), ``B`` of a column-parallel one too (by rows); the other one is whole on every tp rank."""
    if f".{LORA_A}." in name:
        return "rowwise" if projection_role == "rowwise" else "replicated"
    return projection_role if projection_role in ("colwise", "kv_colwise") else "replicated"


class _SingleBlock:
    """An adapter stand-in whose model is one decoder block (for muon_parameters)."""

    @staticmethod
    def named_blocks(block):
        return [("", block)]


def _moe_intermediate(hf_config) -> int:
    """One routed expert's intermediate size (``moe_intermediate_size``; Mixtral: ``intermediate_size``)."""
    if not is_moe(hf_config):
        return 0
    return int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)


def _shared_expert_intermediate(hf_config) -> int:
    """The dense shared expert's intermediate size: Qwen2-MoE's ``shared_expert_intermediate_size``, DeepSeek-V3's
    ``n_shared_experts x moe_intermediate_size``; 0 without one."""
    qwen = getattr(hf_config, "shared_expert_intermediate_size", None)
    if qwen:
        return int(qwen)
    return int(getattr(hf_config, "n_shared_experts", None) or 0) * _moe_intermediate(hf_config)
