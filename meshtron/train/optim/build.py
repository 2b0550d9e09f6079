"""The optimizer: AdamW with decoupled weight decay on matrices only, or Muon for the blocks' matrices
(meshtron.train.optim.muon); and the learning-rate schedules (warmup, then cosine, linear, constant or
warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.train.optim.muon import MuonAdamW, muon_parameters

FUSED_DEVICES = ("cpu", "cuda")
"""Devices whose fused AdamW kernel meshtron uses (one kernel per parameter group instead of a dozen
foreach ops): on the CPU it takes about a third of the foreach step's time."""


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, parts=None, adapter=None, compute_dtype: torch.dtype | None = None
) -> torch.optim.AdamW:
    """AdamW (``train.optimizer=adamw``); weight decay applies to 2-D+ parameters (matrices, embeddings), not to norms
    or biases. With ``train.optimizer=muon``, Muon for the decoder blocks' matrices of ``parts`` (the model, or this
    rank's pipeline stages; ``adapter``: their family's) and AdamW for the rest (meshtron.train.optim.muon); its
    Newton-Schulz iterations run in bf16 when ``compute_dtype`` (the mixed precision's) is bf16, else in float32.

    Fused on CPU and CUDA parameters, foreach elsewhere (the meta device of ``--dry-run``).
    """
    muon = muon_parameters(parts or [model], adapter) if cfg.optimizer == "muon" else []
    taken = {id(p) for p in muon}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad and id(param) not in taken:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [  # an empty group (LoRA trains no norm) would break the checkpoint's flattened optimizer state
        group
        for group in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if group["params"]
    ]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in decay + no_decay)
    kernel = {"fused": True} if fused else {"foreach": True}
    adamw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **kernel)
    if cfg.optimizer == "muon":
        ns_dtype = torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32
        return MuonAdamW(
            muon, groups, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps, ns_dtype=ns_dtype, **adamw
        )
    return torch.optim.AdamW(groups, **adamw)


# How much of the way from lr down to min_lr is left at a fraction ``progress`` of the decay.
DECAY_FACTORS = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "1-sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for 0-based optimizer step ``step``: linear warmup over ``warmup_steps``, then
    ``cfg.lr_schedule`` (docs/schedules.md). A function of the step and this run's settings only, so a run
    resumed with a larger ``train.steps`` follows the longer schedule from where it is (WSD: a longer stable phase)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
        decay_start, shape = max(cfg.warmup_steps, cfg.steps - decay_steps), cfg.decay_shape
    else:  # cosine or linear, over every step after the warmup
        decay_start, shape = cfg.warmup_steps, cfg.lr_schedule
    progress = min(1.0, max(0.0, (step - decay_start) / max(1, cfg.steps - decay_start)))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * DECAY_FACTORS[shape](progress)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr if cfg.lr else 0.0)


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the optimizer's learning rates to this run's schedule at the scheduler's step (after a resume: the
    checkpoint holds the rate its own settings gave, which a resumed run with other ones must not train with)."""
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
