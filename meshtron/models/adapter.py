"""Model-family adapters: the only place that knows where a model keeps its parts.

Parallelism code asks an adapter for the embeddings, decoder blocks, final norm and head; it never
reaches into a model's internals itself. The supported families (``meshtron.models.families``) share
one anatomy, except GPT-NeoX, whose paths ``meshtron.models.gpt_neox.GPTNeoXAdapter`` gives; the
adapter also reproduces what a model does outside its blocks (Granite's embedding and logit scaling,
Gemma 2's final logit soft-capping), since meshtron runs the stages and the head itself.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.errors import MeshtronError
from meshtron.models.families import FAMILIES, family_of, supported_families
from meshtron.models.moe import checkpoint_renames, moe_blocks

# Wrappers that parallelism adds around modules; they are not part of a parameter's real name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name as in the model's own state dict, without wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# Tensor-parallel roles of a decoder block's submodules (paths relative to the block). The roles are
# turned into PyTorch parallel styles by meshtron.distributed.tensor_parallel:
#   attention / mlp   the module whose input is gathered over the sequence (or kept replicated)
#   attention_positional  the same for an attention called with its input positionally (GPT-NeoX)
#   attention_sinks   the same for an attention that also holds per-head parameters (gpt-oss's sinks [H]):
#                     split with its heads (Shard(0))
#   colwise / rowwise output features / input features split over tp
#   kv_colwise        k/v projections: split by KV head, or replicated when tp > KV heads
#   norm              a norm on the residual stream (sequence-sharded under sequence parallel)
#   head_norm         a per-head norm inside attention (Qwen3's q_norm / k_norm): works on local heads
#   gathered_norm     a norm over all heads' features (OLMo 2's q_norm / k_norm): runs on gathered heads
#   replicated_block  a module computed whole on every tp rank on the gathered sequence (a sparse MoE block:
#                     router, experts and shared expert); set for every block ``moe.moe_blocks`` finds
_BLOCK_TP_ROLES = {
    "input_layernorm": "norm",
    "self_attn": "attention",
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "kv_colwise",
    "self_attn.v_proj": "kv_colwise",
    "self_attn.o_proj": "rowwise",
    "self_attn.q_norm": "head_norm",
    "self_attn.k_norm": "head_norm",
    "post_attention_layernorm": "norm",
    "mlp": "mlp",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}  # plus each family's extra roles (meshtron.models.families)
# Roles of the parts outside the blocks (paths relative to the whole model).
_TOP_TP_ROLES = {"model.embed_tokens": "embedding", "model.norm": "norm", "lm_head": "head"}


@dataclass(frozen=True)
class AttentionShape:
    """Head counts of a model's attention, as the config gives them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Width of a query / key head."""
    value_head_dim: int | None = None
    """Width of a value head when it differs from ``head_dim`` (DeepSeek-V3's multi-head latent attention)."""

    rope_dim: int | None = None
    """Width of the rotary part of a query / key head when only part of it is rotated (MLA's ``qk_rope_head_dim``)."""

    @property
    def v_dim(self) -> int:
        return self.value_head_dim or self.head_dim


@dataclass(frozen=True)
class DecoderAdapter:
    """Anatomy of a ``XForCausalLM`` whose body lives at ``.model`` with ``layers``, ``embed_tokens``, ``norm``."""

    family: str

    def body(self, model: nn.Module) -> nn.Module:
        return model.model

    def blocks(self, model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
        """The decoder blocks: a ModuleList, or under pipeline parallelism a ModuleDict of this stage's
        blocks keyed by their index in the whole model (so parameter names do not change)."""
        return self.body(model).layers

    def named_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(index as a string, block) for every block this model holds, in order."""
        return list(self.blocks(model).named_children())

    def replace_block(self, model: nn.Module, name: str, block: nn.Module) -> None:
        """Put ``block`` (e.g. a checkpoint wrapper) in place of the block called ``name``."""
        self.blocks(model).register_module(name, block)

    def keep_stage(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        """Drop every part of a (meta-device) model that a pipeline stage does not hold.

        The stage keeps blocks ``layers`` under their original names, the embeddings when ``first`` and
        the final norm and head when ``last``; rotary embeddings (no parameters) stay on every stage.
        """
        blocks = self.blocks(model)
        self.body(model).layers = nn.ModuleDict({str(i): blocks[i] for i in layers})
        if not first:
            self.body(model).embed_tokens = None
        if not last:
            self.body(model).norm = None
            model.lm_head = None

    def run_stage(self, model: nn.Module, hidden: torch.Tensor, inputs: dict, first: bool, last: bool) -> torch.Tensor:
        """A pipeline stage's computation: [embeddings] -> its blocks -> [final norm]. The head is
        applied by the loss (``meshtron.train.loss.head``), as without pipelining.

        ``inputs`` holds this rank's ``input_ids`` and ``position_ids`` and, when meshtron's attention is
        in use, the ``sequence_layout``; ``hidden`` is the previous stage's output (ignored when first).
        Without meshtron's attention each block gets the mask of its layer type that the model's own forward
        would build (causal, or sliding-window causal), for the model's attention implementation.
        """
        from meshtron.models.attention import layer_type, model_attention_masks

        positions = inputs["position_ids"]
        if first:
            hidden = self.embed(model, inputs["input_ids"])
        blocks = self.named_blocks(model)
        kinds = [layer_type(model.config, int(name)) for name, _ in blocks]
        if "sequence_layout" in inputs:  # meshtron's attention: document masks, context parallelism
            masks, extra = dict.fromkeys(kinds), {"sequence_layout": inputs["sequence_layout"]}
        else:
            masks = model_attention_masks(model.config, hidden, positions, kinds, **self.mask_overlays(model.config))
            extra = {}
        rotary = self.rotary_embeddings(model, hidden, positions, kinds)
        for (_, block), kind in zip(blocks, kinds):
            hidden = block(
                hidden,
                attention_mask=masks[kind],
                position_ids=positions,
                use_cache=False,
                position_embeddings=rotary[kind],
                **extra,
            )
        if last:
            hidden = self.final_norm(model)(hidden)
        return hidden

    def rotary_embeddings(self, model: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, kinds) -> dict:
        """(cos, sin) per layer type of ``kinds``: one rotary embedding shared by every layer here."""
        shared = self.body(model).rotary_emb(hidden, positions)
        return dict.fromkeys(kinds, shared)

    def mask_overlays(self, config) -> dict[str, dict]:
        """Extra keyword arguments of a layer type's mask function (see ``attention.model_attention_masks``)."""
        return {}

    @property
    def norm_init(self) -> float:
        """Fresh value of norm weights: 0 where norms scale by ``1 + weight`` (Gemma), else 1."""
        return 0.0 if FAMILIES[self.family].zero_centered_norms else 1.0

    def embed(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings as the model's body computes them before its blocks (Granite scales them;
        Gemma's scaling lives in its embedding module)."""
        hidden = self.body(model).embed_tokens(input_ids)
        multiplier = getattr(model.config, "embedding_multiplier", None)
        return hidden if multiplier in (None, 1, 1.0) else hidden * multiplier

    def return_hidden_states(self, model: nn.Module) -> None:
        """Make ``model(...)`` return the final (normed) hidden states instead of logits: meshtron's loss
        applies the head itself, chunk by chunk. The module's own ``__call__`` (and so FSDP's hooks on
        it) stays; only its ``forward`` changes."""

        def forward(module, input_ids, position_ids=None, **kwargs):
            return self.body(module)(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state

        model.forward = types.MethodType(forward, model)

    def head_parameters(self, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias or None) of the output head, as the module holds them right now."""
        head = self.lm_head(model)
        weight, bias = head.weight, getattr(head, "bias", None)
        scaling = getattr(model.config, "logits_scaling", None)  # Granite divides its logits by it
        if scaling not in (None, 1, 1.0):
            weight, bias = weight / scaling, (bias / scaling if bias is not None else None)
        scale = getattr(model.config, "logit_scale", None)  # Cohere multiplies them by it
        if scale not in (None, 1, 1.0):
            weight, bias = weight * scale, (bias * scale if bias is not None else None)
        return weight, bias

    def logit_softcap(self, model: nn.Module) -> float | None:
        """The cap of the model's final logit soft-capping (``cap * tanh(logits / cap)``, Gemma 2), or None."""
        return getattr(model.config, "final_logit_softcapping", None) or None

    def embeddings(self, model: nn.Module) -> nn.Module:
        return self.body(model).embed_tokens

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.body(model).norm

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [block.self_attn for _, block in self.named_blocks(model)]

    def attention_shape(self, config) -> AttentionShape:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return AttentionShape(heads, kv_heads, head_dim)

    def set_local_heads(self, model: nn.Module, num_heads: int, num_kv_heads: int) -> None:
        """Tell each attention module how many query heads share a KV head on this rank."""
        for attention in self.attention_modules(model):
            attention.num_key_value_groups = num_heads // num_kv_heads

    def use_attention(self, model: nn.Module, name: str) -> None:
        """Route every attention module to the attention function registered with transformers as ``name``."""
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise MeshtronError(
                f"model family '{self.family}' does not take a custom attention function; "
                "set parallel.cp=1 and data.mask_documents=false"
            )

    def block_tp_roles(self, block: nn.Module) -> dict[str, str]:
        """Tensor-parallel role of each submodule of a decoder block that has one (see ``_BLOCK_TP_ROLES``)."""
        present = {name for name, _ in block.named_modules()}
        roles = {**_BLOCK_TP_ROLES, **FAMILIES[self.family].extra_roles}
        roles = {path: role for path, role in roles.items() if path in present}
        # A sparse MoE block (router, experts, shared expert) is kept whole on every tp rank: no role inside it.
        for moe_path, _ in moe_blocks(block):
            roles = {path: role for path, role in roles.items() if not path.startswith(moe_path + ".")}
            roles[moe_path] = "replicated_block"
        return roles

    def top_tp_roles(self, model: nn.Module) -> dict[str, str]:
        """Roles of the parts outside the blocks that ``model`` holds (a pipeline stage may lack some)."""
        present = {name for name, _ in model.named_modules()}
        return {path: role for path, role in _TOP_TP_ROLES.items() if path in present}

    def split_fused_projections(self, model: nn.Module) -> None:
        """Give a (meta-device) model's fused projections as separate modules for training (Phi-3); a no-op
        for families without them."""

    def fuse_projections(self, model: nn.Module) -> None:
        """Undo ``split_fused_projections`` (before saving a Hugging Face model)."""

    @property
    def fuses_projections(self) -> bool:
        """Whether the family's Hugging Face model fuses projections that meshtron trains apart (Phi-3)."""
        return type(self).split_fused_projections is not DecoderAdapter.split_fused_projections

    def embedding_name(self) -> str:
        """Name of the embedding weight in the model's state dict and checkpoints."""
        return "model.embed_tokens.weight"

    def checkpoint_sources(self, name: str, config) -> list[tuple[str, int | None]]:
        """Where a Hugging Face checkpoint keeps parameter ``name``, candidates in order of preference:
        (checkpoint name, None) for a tensor of the parameter's shape, (checkpoint name, first row) for a row
        range of a fused tensor. A tied head falls back to the embedding."""
        sources: list[tuple[str, int | None]] = [(name, None)]
        sources += [(renamed, None) for renamed in checkpoint_renames(name, self.family)]  # MoE block names
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            sources.append((self.embedding_name(), None))
        return sources

    def tie_weights(self, model: nn.Module) -> None:
        """Share the head's weight with the embeddings again (parallelizing replaces both parameters)."""
        if getattr(model.config, "tie_word_embeddings", False) and model.lm_head is not None:
            self.lm_head(model).weight = self.embeddings(model).weight

    def check_anatomy(self, model: nn.Module) -> None:
        try:
            parts = (self.blocks(model), self.embeddings(model), self.final_norm(model), self.lm_head(model))
        except AttributeError as err:
            raise MeshtronError(
                f"model family '{self.family}' does not have the decoder layout meshtron supports ({err}); "
                f"use one of {supported_families()}"
            ) from None
        if not isinstance(parts[0], nn.ModuleList):
            raise MeshtronError(f"model family '{self.family}': decoder blocks are not an nn.ModuleList")

    @torch.no_grad()
    def init_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) after the model
        left the meta device."""
        for module in model.modules():
            if hasattr(module, "scalar_embed_scale"):  # Gemma's scaled embedding
                module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)
            inv_freqs = [name for name, _ in module.named_buffers(recurse=False) if name.endswith("inv_freq")]
            if inv_freqs and hasattr(module, "config"):
                fresh = type(module)(config=module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(device))
                if hasattr(fresh, "attention_scaling"):
                    module.attention_scaling = fresh.attention_scaling


def adapter_for(config) -> DecoderAdapter:
    """The adapter of a Hugging Face config's family; a ConfigError listing the supported families for others."""
    adapter_path = family_of(config).adapter
    if not adapter_path:
        return DecoderAdapter(config.model_type)
    module, _, name = adapter_path.rpartition(".")
    return getattr(importlib.import_module(module), name)(config.model_type)
