"""The distillation loss, unfused (whole logits, plain autograd): the first version, replaced by the fused one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshtron.train.loss.head import _replicated

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillOptions:
    divergence: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    alpha: float = 0.0


def _logits(h, w, b, dtype, softcap):
    if dtype is not None:
        h, w = h.to(dtype), w.to(dtype)
        b = b.to(dtype) if b is not None else None
    else:
        h = h.to(w.dtype)
    z = F.linear(h, w, b)
    if isinstance(z, DTensor):
        z = z.full_tensor()
    z = z.float()
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z


def distill_loss_sum(
    hidden,
    teacher_hidden,
    labels,
    weight,
    bias,
    teacher_weight,
    teacher_bias,
    options,
    *,
    compute_dtype=None,
    chunk_size=0,
    softcap=None,
    teacher_softcap=None,
    compiled=False,
):
    hidden = _replicated(hidden, weight).flatten(0, 1)
    if isinstance(teacher_hidden, DTensor):
        teacher_hidden = teacher_hidden.full_tensor()
    labels = labels.flatten()
    with torch.no_grad():
        tz = _logits(
            _replicated(teacher_hidden, teacher_weight).flatten(0, 1),
            teacher_weight,
            teacher_bias,
            compute_dtype,
            teacher_softcap,
        )
    z = _logits(hidden, weight, bias, compute_dtype, softcap)
    valid = labels != -100
    ce = F.cross_entropy(z, labels, ignore_index=-100, reduction="sum")
    T = options.temperature
    s, t = F.log_softmax(z / T, -1), F.log_softmax(tz / T, -1)
    if options.divergence == "forward_kl":
        d = (t.exp() * (t - s)).sum(-1)
    elif options.divergence == "reverse_kl":
        d = (s.exp() * (s - t)).sum(-1)
    else:
        beta = options.beta
        m = torch.logsumexp(torch.stack([s + torch.log1p(torch.tensor(-beta)), t + torch.log(torch.tensor(beta))]), 0)
        d = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    div = (d * valid).sum()
    loss = options.alpha * ce + (1 - options.alpha) * div
    return loss, torch.stack([ce.detach(), div.detach()])
