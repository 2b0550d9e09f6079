"""A preference micro-batch's targets as one tensor.

A pipeline schedule splits one ``target`` tensor over its microbatches and context parallelism cuts labels over
the sequence, so everything the preference loss needs travels as one int64 tensor of shape ``(B, 2 S + 2)``: this
rank's labels ``(B, S)``, each position's answer (``runs``: 0 chosen, 1 rejected, -1 none;
meshtron.train.loss.preference.preference_runs, computed on whole rows before the cut) and the reference model's
per-row log-probabilities ``(B, 2)`` as the bits of float64 numbers (exact; zeros for reference-free objectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairCounts:
    """The global batch's figures that normalize the preference losses (every rank counts them from the data)."""

    pairs: int
    """Pairs (rows) of the global batch."""
    chosen_tokens: int
    """Labelled tokens of the global batch's chosen answers (the NLL terms' denominator), at least 1."""


def pack_targets(labels: torch.Tensor, runs: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, 2 S + 2)`` int64: ``labels`` and ``runs`` (B, S) and ``reference`` (B, 2) (None: zeros)."""
    if reference is None:
        reference = torch.zeros(labels.shape[0], 2, dtype=torch.float64, device=labels.device)
    bits = reference.to(torch.float64).to(labels.device, non_blocking=True).contiguous().view(torch.int64)
    return torch.cat([labels, runs.to(labels.dtype), bits], dim=1)


def unpack_targets(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels, runs, reference as float32) of a ``pack_targets`` tensor (or a microbatch's rows of one)."""
    length = (target.shape[1] - 2) // 2
    labels, runs = target[:, :length], target[:, length : 2 * length]
    reference = target[:, 2 * length :].contiguous().view(torch.float64).float()
    return labels, runs, reference


def with_reference(target: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``target`` with its reference log-probabilities replaced by ``reference`` (B, 2)."""
    labels, runs, _ = unpack_targets(target)
    return pack_targets(labels, runs, reference)
