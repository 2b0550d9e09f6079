"""Fault injection for tests: make a chosen rank fail at a chosen step, on the first start only.

Set ``MESHTRON_FAULT=kill:step=S:rank=R`` in the environment of the workers and rank ``R`` kills itself
with SIGKILL at the start of step ``S`` (1-based, as the logs count), as a crashed or out-of-memory process
would end. Only on the first start of a run (``TORCHELASTIC_RESTART_COUNT`` 0), so that a restarted run goes
on. Unset, nothing happens: training calls ``before_step``, which returns at once. Not a user setting.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from meshtron.errors import ConfigError
from meshtron.train.restart import restart_count

ENV = "MESHTRON_FAULT"
KINDS = ("kill",)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int

    def before_step(self, step: int, rank: int) -> None:
        """Called at the start of each (1-based) ``step`` by every rank."""
        if step == self.step and rank == self.rank and restart_count() == 0 and self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


def fault_from_env(environ=os.environ) -> Fault | None:
    """The fault ``MESHTRON_FAULT`` asks for, or None."""
    spec = environ.get(ENV, "")
    if not spec:
        return None
    kind, *fields = spec.split(":")
    try:
        values = dict(field.split("=", 1) for field in fields)
        fault = Fault(kind, int(values["step"]), int(values["rank"]))
    except (KeyError, ValueError):
        fault = None
    if fault is None or kind not in KINDS:
        raise ConfigError(f"{ENV}={spec!r}: expected one of {', '.join(KINDS)} as kind:step=S:rank=R")
    return fault
