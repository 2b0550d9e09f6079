"""The optimizer: AdamW with decoupled weight decay on matrices only, or Muon for the blocks' matrices
(meshtron.train.optim.muon); and the learning-rate schedules (warmup, then cosine, linear, constant or
warmup-stable-decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtron.config import Config, OptimizerConfig
from meshtron.train.optim.registry import optimizer_entry, optimizer_settings


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, parts=None, adapter=None, compute_dtype: torch.dtype | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``optimizer.name`` names (meshtron.train.optim.registry) over the trained parameters of
    ``model``: AdamW (weight decay on 2-D+ parameters, matrices and embeddings, not on norms or biases), or Muon for
    the decoder blocks' matrices of ``parts`` (the model, or this rank's pipeline stages; ``adapter``: their
    family's) and AdamW for the rest; Muon's Newton-Schulz runs in bf16 when ``compute_dtype`` (the mixed
    precision's) is bf16, else in float32.

    AdamW is fused on CPU and CUDA parameters, foreach elsewhere (the meta device of ``--dry-run``).
    """
    settings = optimizer_settings(cfg)
    build = optimizer_entry(cfg.name).build
    return build(model, cfg, settings, parts=parts, adapter=adapter, compute_dtype=compute_dtype)


# How much of the way from lr down to min_lr is left at a fraction ``progress`` of the decay.
DECAY_FACTORS = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "1-sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for 0-based optimizer step ``step``: linear warmup over ``warmup_steps``, then
    ``schedule.kind`` (docs/schedules.md). A function of the step and this run's settings only, so a run
    resumed with a larger ``train.steps`` follows the longer schedule from where it is (WSD: a longer stable phase)."""
    s, lr, steps = cfg.schedule, cfg.optimizer.lr, cfg.train.steps
    if s.warmup_steps and step < s.warmup_steps:
        return lr * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return lr
    if s.kind == "wsd":
        decay_steps = max(1, round(s.decay_fraction * steps))
        decay_start, shape = max(s.warmup_steps, steps - decay_steps), s.decay_shape
    else:  # cosine or linear, over every step after the warmup
        decay_start, shape = s.warmup_steps, s.kind
    progress = min(1.0, max(0.0, (step - decay_start) / max(1, steps - decay_start)))
    return s.min_lr + (lr - s.min_lr) * DECAY_FACTORS[shape](progress)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    lr = cfg.optimizer.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / lr if lr else 0.0)


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the optimizer's learning rates to this run's schedule at the scheduler's step (after a resume: the
    checkpoint holds the rate its own settings gave, which a resumed run with other ones must not train with)."""
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
