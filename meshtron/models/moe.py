"""Mixture-of-experts anatomy: where a Hugging Face MoE model keeps its routers and experts.

transformers 5 gives every MoE family the same shape: a sparse MoE block (at ``block.mlp``) with a router
``gate`` (``forward(hidden (T, H)) -> (router logits (T, E), top-k weights (T, k), top-k expert ids (T, k))``)
and ``experts`` holding fused 3-D parameters ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
(``forward(hidden (T, H), top_k_index, top_k_weights) -> (T, H)``); Qwen2-MoE adds a dense
``shared_expert`` and its ``shared_expert_gate``. Parallelism and the router loss find them here, never
by reaching into a family's modules themselves. gpt-oss differs (``ExpertsAnatomy``): its router is ``router``
(with a bias; the weights a softmax over the top-k logits), its experts are stored transposed with gate and up
interleaved, biases, and a clamped SwiGLU, and its block returns ``(hidden, router scores)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ExpertsAnatomy:
    """How one family's sparse block routes and how its experts hold and compute their FFN (the defaults: the
    transformers 5 shape of the module docstring)."""

    router: str = "gate"
    """The router's attribute in the sparse block (gpt-oss: ``router``)."""
    router_bias: bool = False
    """The router's linear has a bias (gpt-oss)."""
    top_k_softmax: bool = False
    """The routing weights are a softmax over the top-k logits (gpt-oss) rather than the top-k of a softmax over
    every expert (renormalized where the family does)."""
    transposed: bool = False
    """Expert matrices stored ``[E, in, out]`` (gpt-oss: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``),
    rather than ``[E, out, in]``."""
    interleaved: bool = False
    """Gate and up features interleaved (gate at even, up at odd output features) rather than gate then up."""
    biases: bool = False
    """The experts hold ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]`` (gpt-oss)."""
    activation: str = "act_fn"
    """``act_fn``: ``experts.act_fn(gate) * up``; ``clamped_swiglu`` (gpt-oss): gate clamped to at most
    ``experts.limit``, up to +-limit, ``(up + 1) * gate * sigmoid(experts.alpha * gate)``."""
    own_balance_bias: bool = False
    """The router chooses with a balancing bias of its own (DeepSeek-V3's ``MODEL_ROUTER_BIAS``), which is then the
    one ``moe.router_balance=bias`` moves, and its default."""


DEFAULT_ANATOMY = ExpertsAnatomy()
ANATOMIES: dict[str, ExpertsAnatomy] = {
    "gpt_oss": ExpertsAnatomy(
        router="router",
        router_bias=True,
        top_k_softmax=True,
        transposed=True,
        interleaved=True,
        biases=True,
        activation="clamped_swiglu",
    ),
    "deepseek_v3": ExpertsAnatomy(own_balance_bias=True),
}
"""Families whose sparse block differs from the default anatomy, by ``model_type``."""


def _model_type_of(module: nn.Module) -> str | None:
    """The transformers model directory of ``module``'s class (``transformers.models.gpt_oss.modeling_gpt_oss`` ->
    ``gpt_oss``, which is its ``model_type``), through wrapper classes parallelism adds (FSDP's)."""
    for cls in type(module).__mro__:
        parts = cls.__module__.split(".")
        if len(parts) >= 4 and parts[:2] == ["transformers", "models"]:
            return parts[2]
    return None


def experts_anatomy(module: nn.Module) -> ExpertsAnatomy:
    """The anatomy of the family a sparse block or experts module belongs to."""
    return ANATOMIES.get(_model_type_of(module), DEFAULT_ANATOMY)


def router_of(block: nn.Module) -> nn.Module:
    """The router of a sparse block ``moe_blocks`` found (``gate``; gpt-oss: ``router``)."""
    return getattr(block, experts_anatomy(block.experts).router)


ROUTER_BIAS = "balance_bias"
"""The buffer name of a router's auxiliary-loss-free balancing bias (``...mlp.gate.balance_bias``,
meshtron.train.moe.router_balance): state that training changes without a gradient."""
MODEL_ROUTER_BIAS = "e_score_correction_bias"
"""The balancing bias a family's own router has (DeepSeek-V3), used in place of ``ROUTER_BIAS``."""
ROUTER_BIASES = (ROUTER_BIAS, MODEL_ROUTER_BIAS)


def has_own_router_bias(config) -> bool:
    """Whether the family's routers choose with a balancing bias of their own (``ExpertsAnatomy.own_balance_bias``),
    from its config (before any model is built)."""
    return ANATOMIES.get(getattr(config, "model_type", None), DEFAULT_ANATOMY).own_balance_bias


def is_moe(config) -> bool:
    """Whether the model routes tokens to experts."""
    return num_experts(config) > 0


def num_experts(config) -> int:
    """Experts per MoE layer (``num_experts``; Mixtral: ``num_local_experts``); 0 for a dense model."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def experts_per_token(config) -> int:
    """Experts each token is routed to (top-k)."""
    return int(getattr(config, "num_experts_per_tok", 0) or 0)


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, sparse MoE block) for every MoE block ``model`` holds (a pipeline stage: its own),
    in order. A block is a module with an ``experts`` module of 3-D parameters and a router (``gate``, or the
    attribute its family's ``ExpertsAnatomy`` names)."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is None or getattr(experts, "gate_up_proj", None) is None:
            continue
        if getattr(module, experts_anatomy(experts).router, None) is not None:
            found.append((name, module))
    return found


def layer_index(name: str) -> int:
    """The decoder layer index in a qualified module name (``model.layers.3.mlp`` -> 3)."""
    return int(re.search(r"(?:^|\.)layers\.(\d+)\.", name).group(1))


def moe_layer_indices(model: nn.Module) -> list[int]:
    """The decoder layer index of each of ``moe_blocks(model)``, in the same order."""
    return [layer_index(name) for name, _ in moe_blocks(model)]


# Per-expert checkpoint names of the fused expert parameters, as transformers' save_pretrained writes them and
# Hub checkpoints hold them: {family: (block path in the checkpoint, {fused name: per-expert parts along dim 1})}.
# ``gate_up_proj [E, 2I, H]`` is expert e's gate rows then its up rows; ``down_proj [E, H, I]`` is its down.
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_CHECKPOINT_EXPERTS = {
    "qwen3_moe": (".mlp.", _EXPERT_PARTS),
    "qwen2_moe": (".mlp.", _EXPERT_PARTS),
    "olmoe": (".mlp.", _EXPERT_PARTS),
    "deepseek_v3": (".mlp.", _EXPERT_PARTS),
    "mixtral": (".block_sparse_moe.", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}


def checkpoint_renames(name: str, model_type: str) -> list[str]:
    """Other names a checkpoint may give parameter ``name`` of an MoE family's block (Mixtral's Hub and
    save_pretrained checkpoints: ``block_sparse_moe`` for ``mlp``); empty for the rest."""
    block_path = _CHECKPOINT_EXPERTS.get(model_type, (".mlp.",))[0]
    if block_path != ".mlp." and ".mlp." in name:
        return [name.replace(".mlp.", block_path, 1)]
    return []


def read_experts(name: str, shape: tuple[int, ...], reader, region, model_type: str):
    """``region`` (None: all) of the fused expert parameter ``name`` of shape ``shape`` ([E, rows, cols]),
    assembled from a checkpoint that keeps each expert's matrices apart (``...experts.{e}.{part}.weight``);
    each per-expert tensor is read only in the rows and columns the region covers. None when ``name`` is no
    fused expert parameter of the family or the checkpoint does not hold per-expert tensors for it."""
    import torch

    from meshtron.errors import MeshtronError

    if model_type not in _CHECKPOINT_EXPERTS or ".experts." not in name:
        return None
    block_path, parts_of = _CHECKPOINT_EXPERTS[model_type]
    prefix, _, fused = name.rpartition(".experts.")
    if fused not in parts_of or len(shape) != 3:
        return None
    prefixes = [prefix + ".experts."]
    if block_path != ".mlp." and ".mlp" in prefix:  # also the model's own block name
        prefixes.insert(0, prefix.replace(".mlp", block_path.rstrip("."), 1) + ".experts.")
    parts = parts_of[fused]
    for base in prefixes:
        if f"{base}0.{parts[0]}.weight" in reader:
            break
    else:
        return None
    experts, rows, cols = shape
    part_rows = rows // len(parts)
    region = region or tuple(slice(0, size) for size in shape)
    pieces = []
    for expert in range(region[0].start, region[0].stop):
        expert_rows = []
        for index, part in enumerate(parts):
            part_name = f"{base}{expert}.{part}.weight"
            if part_name not in reader or reader.shape(part_name) != (part_rows, cols):
                got = reader.shape(part_name) if part_name in reader else "no such weight"
                raise MeshtronError(
                    f"model.name_or_path: expert weight '{part_name}' is {got} but the config asks for "
                    f"{(part_rows, cols)} ({experts} experts of '{name}' {shape}); the weights do not belong to "
                    "this config.json"
                )
            start, stop = index * part_rows, (index + 1) * part_rows
            lo, hi = max(region[1].start, start), min(region[1].stop, stop)
            if lo < hi:
                expert_rows.append(reader.get(part_name, (slice(lo - start, hi - start), region[2])))
        pieces.append(torch.cat(expert_rows) if len(expert_rows) > 1 else expert_rows[0])
    if not pieces:
        return torch.empty(tuple(r.stop - r.start for r in region))
    return torch.stack(pieces)
