"""The training step reads as its phases (issue 58): ``train_step`` is a short sequence of named functions (batches to
the device, scales, forward and backward, the global figures, fp16 overflow, non-finite steps, the update) and
returns a typed StepResult."""

from __future__ import annotations

import dataclasses
import inspect
import typing

MAX_LINES = 60


def test_train_step_is_short_and_returns_a_step_result():
    from meshtron.train.step import StepResult, train_step

    lines = len(inspect.getsourcelines(train_step)[0])
    assert lines < MAX_LINES, f"train_step has {lines} lines; split a phase out"
    assert typing.get_type_hints(train_step)["return"] is StepResult and dataclasses.is_dataclass(StepResult)
