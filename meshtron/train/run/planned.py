"""Planned vs measured in every GPU run: from the first steady step, rank 0's ``metrics.jsonl`` rows carry the
planner's peak memory and step time for the run's own layout and settings (``planned_peak_gb``,
``planned_step_s``) beside the measured ``max_memory_gb`` and ``step_s``, and the log says once how far apart they
are, so that every user calibrates ``meshtron plan`` on their own hardware (docs/planning.md).

The figures are made by ``meshtron.plan.for_run`` (a layer above this one) and handed to ``train``.
"""

from __future__ import annotations

from dataclasses import dataclass

STEADY_STEP = 3
"""The first step of a start whose time and memory are steady: its first step compiles and warms the allocator,
its second measures the activations kept for backward (meshtron.distributed.activation_memory.measure)."""


@dataclass(frozen=True)
class PlannedFigures:
    """The planner's figures for rank 0 of this run."""

    peak_gb: float
    """Peak allocated memory, in ``max_memory_gb``'s unit (GiB: bytes / 2**30)."""
    step_s: float | None
    """Seconds per optimizer step; None for a GPU the planner does not model."""
    hardware: str
    """What the step time assumes (e.g. ``the planner's H100 SXM 80GB``)."""


class PlannedVsMeasured:
    """Adds the planned figures to the metrics rows from the start's ``STEADY_STEP``-th step, and words the
    comparison once."""

    def __init__(self, planned: PlannedFigures | None, start_step: int):
        self.planned = planned
        self.first_step = start_step + STEADY_STEP
        self.reported = False

    def fields(self, step: int) -> dict:
        """The planned figures for the row of ``step`` (1-based): none before the steady step or without a plan."""
        if self.planned is None or step < self.first_step:
            return {}
        fields = {"planned_peak_gb": round(self.planned.peak_gb, 3)}
        if self.planned.step_s is not None:
            fields["planned_step_s"] = round(self.planned.step_s, 4)
        return fields

    def due(self, step: int) -> bool:
        """Whether the comparison's line is said after ``step``: once, at the first steady step, with a plan."""
        return self.planned is not None and not self.reported and step >= self.first_step

    def message(self, step: int, measured_peak_gb: float, step_s: float) -> str | None:
        """The comparison's line, once: at the first steady step (None at every other call)."""
        if not self.due(step):
            return None
        self.reported = True
        planned = self.planned
        text = (
            f"meshtron: planned vs measured at step {step} on rank 0: peak memory {measured_peak_gb:.2f} GiB measured, "
            f"{planned.peak_gb:.2f} planned ({_error(planned.peak_gb, measured_peak_gb)})"
        )
        if planned.step_s is not None:
            text += (
                f"; step {step_s:.3f} s measured, {planned.step_s:.3f} planned ({_error(planned.step_s, step_s)}) "
                f"for {planned.hardware}"
            )
        else:
            text += f"; no planned step time ({planned.hardware} is not a GPU the planner models)"
        return text + " (metrics.jsonl: planned_peak_gb, planned_step_s; docs/planning.md)"


def _error(planned: float, measured: float) -> str:
    """The planner's error relative to the measurement: ``planner +12.0%`` means it planned 12% more."""
    if measured <= 0:
        return "nothing measured"
    return f"planner {(planned - measured) / measured:+.1%}"
