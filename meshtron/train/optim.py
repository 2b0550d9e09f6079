"""AdamW with decoupled weight decay on matrices only, and linear warmup + cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtron.config import TrainConfig

FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose fused AdamW kernel meshtron uses (one kernel per parameter group instead of a dozen
foreach ops): on the CPU it takes about a third of the foreach step's time."""


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay applies to 2-D+ parameters (matrices, embeddings), not to norms or biases.

    Fused on CPU and CUDA parameters, foreach elsewhere (the meta device of ``--dry-run``).
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in decay + no_decay)
    kernel = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based optimizer step ``step``: linear warmup, then cosine from lr down to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr if cfg.lr else 0.0)
