"""The distillation loss of a micro-batch on both heads: the student's hidden states and head, the teacher's final
hidden states (from the micro-batch's targets, meshtron.train.distill.targets) and head, turned into
``alpha`` x the cross-entropy + ``(1 - alpha)`` x the divergence summed over the labelled tokens, chunk by chunk
(meshtron.train.loss.distill). Like the causal loss, it is a token sum: the step divides by the global batch's
labelled tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from meshtron.train.distill.targets import unpack_targets
from meshtron.train.loss.distill import DistillOptions, distill_loss_sum
from meshtron.train.preference.head import HeadOptions


class Teacher(Protocol):
    """What the loss and the step use of the teacher (meshtron.train.distill.teacher.TeacherModel)."""

    def targets(self, input_ids: torch.Tensor, labels: torch.Tensor, bounds=None) -> torch.Tensor | None: ...

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def release(self) -> None: ...

    def param_bytes(self) -> int: ...


@dataclass(frozen=True)
class DistillHead:
    """The distillation loss: its options, how the student's head computes, the teacher."""

    options: DistillOptions
    head: HeadOptions
    teacher: Teacher
    teacher_softcap: float | None = None

    metric_names = ("nll_loss", "divergence")
    """The metric sums ``loss`` returns, in order (means over the global batch's labelled tokens)."""

    def loss(
        self, hidden: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss to back-propagate, its (2,) cross-entropy and divergence sums, detached) of one
        micro-batch whose ``target`` is a ``pack_targets`` tensor; the teacher's head as its forward left it."""
        labels, teacher_hidden = unpack_targets(target)
        teacher_weight, teacher_bias = self.teacher.head()
        return distill_loss_sum(
            hidden,
            teacher_hidden,
            labels,
            weight,
            bias,
            teacher_weight,
            teacher_bias,
            self.options,
            compute_dtype=self.head.compute_dtype,
            chunk_size=self.head.chunk_size,
            softcap=self.head.softcap,
            teacher_softcap=self.teacher_softcap,
            compiled=self.head.compiled,
        )

    def metric_values(self, totals: torch.Tensor, targets: int) -> dict[str, float]:
        """The step's (or an evaluation's) metrics from the global sums ``totals`` over ``targets`` tokens."""
        return {name: float(value) / max(targets, 1) for name, value in zip(self.metric_names, totals.tolist())}
