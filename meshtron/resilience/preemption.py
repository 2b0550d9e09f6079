"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) make every rank finish its step, save a checkpoint and exit
with status 75.

SLURM sends SIGTERM before it ends or preempts a job (or SIGUSR1 some seconds earlier with
``--signal=USR1@120``); torchrun's agent forwards the signals it handles to every worker. Each rank records
a signal when it comes; in every step all ranks agree whether any got one (a flag per signal, summed in the
step's own all-reduce of its loss: meshtron.train.step_stats), so they stop after the same step even when the
signal reached only some of them (a signal that comes after that all-reduce stops the run after the next
step). Then they save a checkpoint at that step (also between ``checkpoint.interval`` steps), wait for it to
be complete, and exit with ``EXIT_PREEMPTED``: running the same command again resumes from it. Further
SIGTERM / SIGUSR1 while stopping are ignored (SLURM may repeat them); a SIGINT while stopping (a second Ctrl-C)
ends the rank at once, without its save. A kill in the middle of the save leaves the previous checkpoint
complete (saves are atomic).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

EXIT_PREEMPTED = 75
"""Exit status after a stop by a signal with the checkpoint saved (``EX_TEMPFAIL``: run again to resume)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
LAUNCHER_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""What torchrun's agent should forward to the workers (``--signals-to-handle``); its default lacks SIGUSR1."""


class Preempted(Exception):
    """Training stopped after a stop signal, with a complete checkpoint of the last step; ``str`` says so."""


class StopSignals:
    """Records SIGTERM / SIGUSR1 / SIGINT while training (a context manager; the earlier handlers come back
    after). Once one came, SIGINT takes its default action back: a second Ctrl-C ends the process at once, even in
    the middle of a collective or a save, where a Python handler would wait for the call to return."""

    def __init__(self) -> None:
        self.received: int = 0
        self.repeated: int = 0
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        if self.received:
            self.repeated += 1  # already stopping: a second SIGTERM / SIGUSR1 must not interrupt the save
        else:
            self.received = signum
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def flags(self) -> list[int]:
        """Whether this rank got each of STOP_SIGNALS (first), for the step's all-reduce to sum over the ranks."""
        return [int(self.received == sig) for sig in STOP_SIGNALS]

    @staticmethod
    def agreed(counts: Sequence[int]) -> str | None:
        """The name of a stop signal that any rank got, from ``flags()`` summed over the ranks, or None; SIGTERM
        before SIGUSR1 before SIGINT when ranks got different ones (every rank decides the same)."""
        got = [sig for sig, count in zip(STOP_SIGNALS, counts, strict=True) if count > 0]
        return signal.Signals(max(got)).name if got else None


def stop_message(signal_name: str, step: int, total: int, checkpoint_name: str) -> str:
    return (
        f"meshtron: stopped by {signal_name} after step {step} of {total}: checkpoint {checkpoint_name} saved; "
        f"run the same command again to resume (exit status {EXIT_PREEMPTED})"
    )
