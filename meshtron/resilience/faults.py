"""Fault injection for tests: make a chosen rank fail in a chosen way at a chosen step of a chosen start.

``MESHTRON_FAULT`` in the workers' environment holds one or more faults separated by commas, each
``kind:step=S:rank=R[:attempt=A]`` (steps 1-based as the logs count them; ``attempt`` is torchrun's
``TORCHELASTIC_RESTART_COUNT`` the fault fires in, 0 by default, so that a restarted run goes on):

- ``kill``: rank R kills itself with SIGKILL at the start of step S, as a crashed or out-of-memory process ends.
- ``hang``: rank R stops at the start of step S (sleeps forever), as a stuck data loader or a dead host would.
- ``term``: rank R sends SIGTERM to its launcher (torchrun's agent) at the start of step S, as SLURM does
  before a preemption; the agent forwards it to every rank. During the checkpoint that follows, rank R sends
  a second SIGTERM to the launcher and to itself.
- ``ctrlc``: rank R sends SIGINT at the start of step S to its launcher's process group, as a terminal's Ctrl-C
  reaches every process of its foreground job (to the launcher alone where it leads no group of its own).
- ``ctrlc2``: as ``ctrlc``, and rank R sends a second Ctrl-C in the save that follows, then waits there a minute, as a
  long save would (a second Ctrl-C has to end it at once).
- ``nan``: step S's loss is made non-finite (every rank; ``rank`` is ignored), once per process.
- ``killsave``: rank R kills itself with SIGKILL in the save of step S, after writing its part.
- ``failsave``: rank R's save of step S fails with "No space left on device".
- ``stale``: rank R's view of ``checkpoint.dir`` at start-up is stale: ``checkpoint.resume=auto`` sees no
  checkpoint newer than step S there (0: none), as a node whose cached directory listing predates the later
  saves would.

Unset, nothing happens. Not a user setting. Training meets the faults only through the run's one fault plan
(``fault_plan``, read once by the run's set-up, meshtron.train.trainer.run_session, and empty in a normal run), which
wraps the components it faults: the start-up's resume point (``stale``), the step's global sums (``nan``: the loss
made NaN after the all-reduce), the CheckpointManager's writes (``inject_save_faults``) and RunGuard's step start
(the rest). No production module reads ``MESHTRON_FAULT`` or asks whether a fault is due.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from meshtron.checkpoint.manager import checkpoint_candidates, first_whole_checkpoint
from meshtron.checkpoint.shared_directory import on_every_rank
from meshtron.errors import ConfigError
from meshtron.resilience.restart import restart_count

if TYPE_CHECKING:
    from meshtron.checkpoint.manager import CheckpointManager

ENV = "MESHTRON_FAULT"
KINDS = ("kill", "hang", "term", "ctrlc", "ctrlc2", "nan", "killsave", "failsave", "stale")
SLOW_SAVE_S = 60
"""How long a ``ctrlc2`` fault's save waits after the second Ctrl-C."""


def _announce(what: str) -> None:
    """One stderr line with the wall-clock time, which bench/recovery.py reads."""
    print(f"meshtron fault: {what} at time {time.time():.3f}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    attempt: int = 0

    def applies(self, kind: str, step: int, rank: int) -> bool:
        return (
            self.kind == kind
            and self.step == step
            and restart_count() == self.attempt
            and (rank == self.rank or kind == "nan")
        )


LAUNCHER_PID_ENV = "MESHTRON_LAUNCHER_PID"
"""Set by ``meshtron train --nproc`` (meshtron.launch) for its workers, whose parent is its forkserver, not itself."""


def launcher_pid() -> int:
    """The process that launched this worker: meshtron's launcher, or torchrun's agent (this process's parent)."""
    return int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())


def _ctrl_c() -> None:
    """SIGINT to the launcher's process group where it leads one (a terminal's job), else to the launcher alone."""
    launcher = launcher_pid()
    if os.getpgid(launcher) == launcher:
        os.killpg(launcher, signal.SIGINT)
    else:
        os.kill(launcher, signal.SIGINT)


@dataclass
class Faults:
    """The run's fault plan: the faults ``MESHTRON_FAULT`` asks for, and the wrappers that inject them into the
    components they fault. Empty (a normal run), every wrapper returns its component unchanged."""

    faults: tuple[Fault, ...] = ()
    fired: set = field(default_factory=set)
    second_term: bool = False
    """A ``term`` fault fired: send the second SIGTERM in the save that follows."""
    second_ctrlc: bool = False
    """A ``ctrlc2`` fault fired: send the second Ctrl-C in the save that follows."""
    nonfinite_now: bool = False
    """The step that started last is a ``nan`` fault's: its global loss is made NaN (``wrap_step_sums``)."""

    def _due(self, kind: str, step: int, rank: int) -> bool:
        for fault in self.faults:
            if fault.applies(kind, step, rank) and fault not in self.fired:
                self.fired.add(fault)
                return True
        return False

    def before_step(self, step: int, rank: int) -> None:
        """Called by every rank at the start of each (1-based) ``step``."""
        if self._due("kill", step, rank):
            _announce(f"rank {rank} killed at the start of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("term", step, rank):
            _announce(f"rank {rank} sends SIGTERM to its launcher at the start of step {step}")
            self.second_term = True
            os.kill(launcher_pid(), signal.SIGTERM)
        for kind in ("ctrlc", "ctrlc2"):
            if self._due(kind, step, rank):
                _announce(f"rank {rank} sends Ctrl-C (SIGINT) to its launcher at the start of step {step}")
                self.second_ctrlc = kind == "ctrlc2"
                _ctrl_c()
        if self._due("hang", step, rank):
            _announce(f"rank {rank} hangs at the start of step {step}")
            while True:
                time.sleep(3600)
        self.nonfinite_now = self.nonfinite(step)

    def nonfinite(self, step: int) -> bool:
        """Whether step ``step``'s loss is to be made non-finite."""
        return self._due("nan", step, -1)

    def stale_view(self, rank: int) -> int | None:
        """The newest step whose checkpoint rank ``rank`` sees at start-up (a ``stale`` fault), or None: all."""
        for fault in self.faults:
            if fault.kind == "stale" and fault.rank == rank and restart_count() == fault.attempt:
                return fault.step
        return None

    def start_up_choice(self, setup, rank: int, directory: Path | None, resume: str):
        """``setup`` (meshtron.train.setup.run_setup.RunSetup) with the resume point that rank ``rank`` chooses with
        ``checkpoint.resume=auto`` (``resume``) from a stale view of the checkpoint ``directory`` (a ``stale`` fault:
        no checkpoint newer than its step seen), else ``setup``. Where rank 0 chooses for every rank
        (``agree_resume_point``), its choice replaces this one."""
        newest = self.stale_view(rank)
        if newest is None or directory is None or resume != "auto":
            return setup
        seen = [path for path in checkpoint_candidates(directory) if int(path.name.removeprefix("step-")) <= newest]
        return replace(setup, resume_from=first_whole_checkpoint(directory, seen), resume_skipped=())

    def wrap_step_sums(self, sums: Callable) -> Callable:
        """The step's global sums (meshtron.train.step_stats.global_step_sums) with a ``nan`` fault's step's loss
        made NaN on every rank (the gradient norm as summed); ``sums`` itself without ``nan`` faults."""
        if not any(fault.kind == "nan" for fault in self.faults):
            return sums

        def faulted(*args, **kwargs):
            loss, grad_norm, flag_sums = sums(*args, **kwargs)
            return (loss * float("nan") if self.nonfinite_now else loss), grad_norm, flag_sums

        return faulted

    def wrap_checkpoints(self, manager: CheckpointManager | None) -> None:
        """Make ``manager``'s saves meet this plan's save faults (``inject_save_faults``); nothing without faults."""
        if self.faults and manager is not None:
            inject_save_faults(manager, self)

    def during_save(self, step: int, rank: int) -> None:
        """Called by every rank in the save of ``step``, after writing its part and before the commit."""
        if self.second_term:
            self.second_term = False
            _announce(f"rank {rank} sends a second SIGTERM during the save of step {step}")
            os.kill(launcher_pid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        if self.second_ctrlc:
            self.second_ctrlc = False
            _announce(f"rank {rank} sends a second Ctrl-C during the save of step {step}")
            _ctrl_c()
            time.sleep(SLOW_SAVE_S)
        if self._due("killsave", step, rank):
            _announce(f"rank {rank} killed in the save of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("failsave", step, rank):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")


def inject_save_faults(manager: CheckpointManager, faults: Faults) -> None:
    """Make ``manager``'s saves call ``faults.during_save`` on every rank once its part is written (an async
    save's: being written), before the commit; a failure there fails the save as a write would."""
    write_state = manager._write_state

    def write_then_fault(step: int, state, partial: Path, meta: dict, started: float) -> None:
        write_state(step, state, partial, meta, started)
        on_every_rank(
            manager.runtime,
            lambda: faults.during_save(step, manager.runtime.rank),
            lambda reason: manager._failed(partial, reason),
        )

    manager._write_state = write_then_fault  # type: ignore[method-assign]  # the injected fault wraps this save


def faults_from_env(environ=os.environ) -> Faults | None:
    """The faults ``MESHTRON_FAULT`` asks for, or None."""
    spec = environ.get(ENV, "")
    if not spec:
        return None
    faults = []
    for item in spec.split(","):
        kind, *fields = item.strip().split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            fault = Fault(kind, int(values.pop("step")), int(values.pop("rank", 0)), int(values.pop("attempt", 0)))
        except (KeyError, ValueError):
            fault = None
        if fault is None or kind not in KINDS or values:
            raise ConfigError(
                f"{ENV}={spec!r}: expected kind:step=S:rank=R[:attempt=A], kind one of {', '.join(KINDS)}"
            )
        faults.append(fault)
    return Faults(tuple(faults))


def fault_plan(environ=os.environ) -> Faults:
    """The run's fault plan: the faults ``MESHTRON_FAULT`` asks for; empty (every wrapper a no-op) when unset."""
    return faults_from_env(environ) or Faults()
