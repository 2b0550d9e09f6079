"""AdamW (``optimizer.name=adamw``): decoupled weight decay on matrices and embeddings only, fused on CPU and CUDA.
Its parameter groups and arguments are also the AdamW half of other optimizers (meshtron.train.optim.muon)."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.config import OptimizerConfig

FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose fused AdamW kernel meshtron uses (one kernel per parameter group instead of a dozen
foreach ops): on the CPU it takes about a third of the foreach step's time."""


@dataclass(frozen=True)
class AdamWSettings:
    """``[optimizer.adamw]``: none of its own (lr, betas, eps and weight decay are ``[optimizer]``'s)."""

    def validate(self) -> None:
        pass


def adamw_groups(model: nn.Module, cfg: OptimizerConfig, taken: Set[int] = frozenset()) -> list[dict]:
    """The trained parameters of ``model`` not in ``taken`` (ids): weight decay on 2-D+ ones, none on the rest."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad and id(param) not in taken:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [  # an empty group (LoRA trains no norm) would break the checkpoint's flattened optimizer state
        group
        for group in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if group["params"]
    ]


def adamw_arguments(cfg: OptimizerConfig, groups: list[dict]) -> dict:
    """torch AdamW's arguments: fused where every parameter of ``groups`` is on CPU or CUDA, foreach elsewhere."""
    params = [p for group in groups for p in group["params"]]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    kernel = {"fused": True} if fused else {"foreach": True}
    return dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **kernel)


def build_adamw(model: nn.Module, cfg: OptimizerConfig, settings: AdamWSettings, **_) -> torch.optim.AdamW:
    groups = adamw_groups(model, cfg)
    return torch.optim.AdamW(groups, **adamw_arguments(cfg, groups))
