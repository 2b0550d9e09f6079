"""LoRA (``[lora]``, docs/lora.md): low-rank adapters beside the decoder blocks' linear projections, the rest frozen.

A target projection ``y = x W^T + b`` becomes ``y = x W^T + b + (alpha / rank) * B(A(dropout(x)))`` with ``A``
(rank x in) and ``B`` (out x rank) trained and ``W`` frozen. The projection stays an ``nn.Linear`` (its class is
swapped for ``LoraLinear``, a subclass) with the adapters as its children ``lora_A`` and ``lora_B``, so the
base weight keeps its name (``...q_proj.weight``: pretrained loads and exports are unchanged) and the adapters are
named as peft names them (``...q_proj.lora_A.weight``). ``A`` starts as peft's (uniform in +-1/sqrt(in), drawn
from the run's seed and the parameter's name, so the same under every layout) and ``B`` at zero: the first step
starts from the base model.

A mixture of experts' routed experts (target ``experts``) hold their projections as fused 3-D parameters
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, meshtron.models.moe); each gets one adapter per expert,
held as 3-D parameters ``experts.lora_A.gate_up_proj [E, r, H]`` / ``experts.lora_B.gate_up_proj [E, 2I, r]``
(and the same for ``down_proj``), split over experts as the fused parameters are (expert parallelism), and the
experts run meshtron.models.experts' grouped GEMMs with them. They take no dropout (as peft's). Experts stored
transposed (gpt-oss: ``[E, in, out]``) get adapters of the same ``[E, r, in]`` / ``[E, out, r]`` shapes; merging
transposes their product.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

from meshtron.config import LoraConfig
from meshtron.errors import ConfigError
from meshtron.models.experts import ExpertAdapters, local_experts_forward
from meshtron.models.moe import experts_anatomy
from meshtron.tensors import local_tensor

LORA_A, LORA_B = "lora_A", "lora_B"
EXPERTS = "experts"
"""The ``lora.targets`` name of a mixture of experts' routed experts (both of their fused projections)."""
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update (made by ``add_lora``, never constructed directly)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scaling


def is_lora_parameter(name: str) -> bool:
    """Whether parameter ``name`` is an adapter's (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return f".{LORA_A}." in name or f".{LORA_B}." in name or name.startswith((f"{LORA_A}.", f"{LORA_B}."))


def lora_init(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """The first value of adapter parameter ``name``: ``A`` uniform in +-1/sqrt(in) (peft's kaiming-uniform with
    a = sqrt(5)), ``B`` zero."""
    if f"{LORA_B}." in name:
        return torch.zeros(tuple(shape))
    bound = 1 / math.sqrt(shape[-1])
    return torch.empty(tuple(shape)).uniform_(-bound, bound, generator=generator)


def _projections(block: nn.Module) -> dict[str, list[tuple[str, nn.Linear]]]:
    """The block's linear projections by their own name (``q_proj``: [(qualified name, module)]), MoE routers
    left out."""
    from meshtron.models.moe import moe_blocks, router_of

    routers = {id(router_of(moe)) for _, moe in moe_blocks(block)}
    found: dict[str, list[tuple[str, nn.Linear]]] = {}
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in routers:
            found.setdefault(name.rsplit(".", 1)[-1], []).append((name, module))
    return found


def add_lora(model: nn.Module, adapter, cfg: LoraConfig) -> list[str]:
    """Freeze ``model`` and give the target projections of its decoder blocks adapters (on the model's device,
    uninitialized: ``meshtron.models.build.materialize`` fills them); train embeddings / head if asked. Returns the
    target names. Call on the whole model, before any parallelism."""
    blocks = adapter.named_blocks(model)
    available = {name for _, block in blocks for name in _projections(block)}
    if any(_routed_experts(block) for _, block in blocks):
        available.add(EXPERTS)
    names = sorted(available)
    targets = list(cfg.targets) or names
    unknown = sorted(set(targets) - set(available))
    if unknown:
        raise ConfigError(
            f"lora.targets: {', '.join(unknown)} is not a linear module of the model's blocks; choose from "
            f"{', '.join(available)}"
        )
    model.requires_grad_(False)
    for _, block in blocks:
        for target in targets:
            for _, linear in _projections(block).get(target, []):
                _attach(linear, cfg)
        if EXPERTS in targets:
            for experts in _routed_experts(block):
                _attach_experts(experts, cfg)
    if cfg.train_embeddings:
        adapter.embeddings(model).requires_grad_(True)
    if cfg.train_head:
        adapter.lm_head(model).requires_grad_(True)
    return targets


def _attach(linear: nn.Linear, cfg: LoraConfig) -> None:
    if type(linear) is not nn.Linear:
        raise ConfigError(
            f"lora.targets: a {type(linear).__name__} projection cannot take an adapter (only torch.nn.Linear); "
            "leave it out of lora.targets"
        )
    device, dtype = linear.weight.device, linear.weight.dtype
    linear.__class__ = LoraLinear
    linear.lora_A = nn.Linear(linear.in_features, cfg.rank, bias=False, device=device, dtype=dtype)
    linear.lora_B = nn.Linear(cfg.rank, linear.out_features, bias=False, device=device, dtype=dtype)
    linear.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    linear.lora_scaling = cfg.alpha / cfg.rank


def _routed_experts(block: nn.Module) -> list[nn.Module]:
    from meshtron.models.moe import moe_blocks

    return [moe.experts for _, moe in moe_blocks(block)]


def _attach_experts(experts: nn.Module, cfg: LoraConfig) -> None:
    """Per-expert adapters for both fused projections, held in two child modules (``lora_A``, ``lora_B``) whose
    parameters are named after the projection; the experts' forward becomes ``lora_experts_forward``."""
    factors = {LORA_A: nn.Module(), LORA_B: nn.Module()}
    transposed = experts_anatomy(experts).transposed  # gpt-oss: [E, in, out]; the adapters stay [out, in]
    for name in EXPERT_PROJECTIONS:
        weight = getattr(experts, name)
        num, out_features, in_features = weight.shape
        if transposed:
            out_features, in_features = in_features, out_features
        like = dict(device=weight.device, dtype=weight.dtype)
        factors[LORA_A].register_parameter(name, nn.Parameter(torch.empty(num, cfg.rank, in_features, **like)))
        factors[LORA_B].register_parameter(name, nn.Parameter(torch.empty(num, out_features, cfg.rank, **like)))
    experts.add_module(LORA_A, factors[LORA_A])
    experts.add_module(LORA_B, factors[LORA_B])
    experts.lora_scaling = cfg.alpha / cfg.rank
    experts.forward = types.MethodType(lora_experts_forward, experts)


def has_expert_adapters(module: nn.Module) -> bool:
    """Whether ``module`` is routed experts given adapters by ``add_lora``."""
    return hasattr(module, "lora_scaling") and not isinstance(module, LoraLinear)


def expert_adapters(experts: nn.Module) -> ExpertAdapters | None:
    """The experts' adapters as local tensors (this rank's experts under expert parallelism); None without."""
    if not has_expert_adapters(experts):
        return None
    a, b = experts.get_submodule(LORA_A), experts.get_submodule(LORA_B)
    gate_up, down = ((local_tensor(getattr(a, n)), local_tensor(getattr(b, n))) for n in EXPERT_PROJECTIONS)
    return ExpertAdapters(gate_up=gate_up, down=down, scaling=experts.lora_scaling)


def lora_experts_forward(self: nn.Module, hidden, top_k_index, top_k_weights):
    """The forward of experts with adapters (without expert parallelism, whose forward adds them itself)."""
    return local_experts_forward(self, hidden, top_k_index, top_k_weights, adapters=expert_adapters(self))
