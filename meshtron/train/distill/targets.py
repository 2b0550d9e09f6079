"""A distillation micro-batch's targets as one tensor.

A pipeline schedule splits one ``target`` tensor over its microbatches, so the student's loss gets its labels and
the teacher's final hidden states of the same sequences together: ``(B, S, H + k)`` in the hidden states' dtype,
the teacher's ``(B, S, H)`` followed by each int64 label's bits as ``k = 8 / itemsize`` values of that dtype (exact).
Both are this rank's context-parallel shard of the sequences (the teacher ran under the student's split).
"""

from __future__ import annotations

import torch


def _label_width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=torch.int64).element_size() // torch.empty((), dtype=dtype).element_size()


def pack_targets(labels: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """``(B, S, H + k)``: ``teacher_hidden`` (B, S, H) and ``labels`` (B, S) int64, bit for bit."""
    bits = labels.to(torch.int64).contiguous().unsqueeze(-1).view(teacher_hidden.dtype)
    return torch.cat([teacher_hidden, bits], dim=-1)


def unpack_targets(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (B, S) int64, the teacher's hidden states (B, S, H)) of a ``pack_targets`` tensor (or rows of one)."""
    width = _label_width(target.dtype)
    labels = target[..., -width:].contiguous().view(torch.int64).squeeze(-1)
    return labels, target[..., :-width]
