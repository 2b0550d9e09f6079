"""A distillation micro-batch's targets as one tensor.

A pipeline schedule splits one ``target`` tensor over its microbatches, so the student's loss gets its labels and
the teacher's final hidden states of the same sequences together: ``(B, S, H + w)`` in the hidden states' dtype, the
teacher's ``(B, S, H)`` followed by a trailer of ``w = 16 / itemsize`` values that holds each int64 label's bits
(exact) and zeros, so that every row of the hidden states starts 16-byte aligned (the teacher's head reads them in
place: cuBLAS takes its fast kernels). Both are this rank's context-parallel shard of the sequences (the teacher ran
under the student's split).
"""

from __future__ import annotations

import torch

_TRAILER_BYTES = 16
_LABEL_BYTES = 8


def _widths(dtype: torch.dtype) -> tuple[int, int]:
    """(trailer, label) widths in values of ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return _TRAILER_BYTES // size, _LABEL_BYTES // size


def empty_targets(labels: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, S, hidden_size + w)`` targets of ``dtype`` holding ``labels`` (B, S), their hidden states left for the
    caller to write (``targets[..., :hidden_size]``)."""
    trailer, width = _widths(dtype)
    target = torch.empty(*labels.shape, hidden_size + trailer, dtype=dtype, device=labels.device)
    target[..., hidden_size:].zero_()
    bits = labels.to(torch.int64).contiguous().unsqueeze(-1).view(dtype)
    target[..., hidden_size : hidden_size + width].copy_(bits)
    return target


def pack_targets(labels: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """``(B, S, H + w)``: ``teacher_hidden`` (B, S, H) and ``labels`` (B, S) int64, bit for bit."""
    target = empty_targets(labels, teacher_hidden.shape[-1], teacher_hidden.dtype)
    target[..., : teacher_hidden.shape[-1]].copy_(teacher_hidden)
    return target


def unpack_targets(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (B, S) int64, the teacher's hidden states (B, S, H), a view) of a ``pack_targets`` tensor (or rows of
    one)."""
    trailer, width = _widths(target.dtype)
    labels = target[..., -trailer : target.shape[-1] - trailer + width].contiguous().view(torch.int64).squeeze(-1)
    return labels, target[..., :-trailer]
