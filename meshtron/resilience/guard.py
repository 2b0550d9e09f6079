"""What keeps a run going around the training loop, in one context manager with one hook per step phase.

- after a restart by torchrun: the log line of what was resumed and lost (meshtron.resilience.restart),
- stop signals: save at the step every rank agrees on and leave with ``Preempted`` (preemption),
- a hang watchdog with the step as its progress mark (watchdog),
- ``train.on_nonfinite=rollback`` (rollback),
- saves at the interval, and an async save committed as soon as every rank has written it,
- the flags that the ranks agree on in every step (stop signals, an async save still being written), which
  ride in the step's own all-reduce (``step_flags``, then ``after_step``): no collective of their own,
- the run's fault plan (faults: tests only, empty in a normal run), whose step hooks and save faults it installs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtron.checkpoint.manager import step_dir_name
from meshtron.resilience.faults import Faults
from meshtron.resilience.preemption import STOP_SIGNALS, Preempted, StopSignals, stop_message
from meshtron.resilience.restart import last_logged_step, restart_count, restart_message
from meshtron.resilience.rollback import NonfiniteRollback
from meshtron.resilience.watchdog import HangWatchdog, start_watchdog

if TYPE_CHECKING:
    from meshtron.config import RunConfig, TrainConfig
    from meshtron.distributed.runtime import Runtime


class RunGuard:
    """``with RunGuard(...) as guard:`` around the loop; ``before_step``, ``rolled_back``, ``after_step`` in it.

    ``train`` and ``run`` are the run's ``[train]`` (steps, ``on_nonfinite``, ``max_rollbacks``) and ``[run]``
    (``collective_timeout_s``); ``resumable`` is the run's meshtron.train.run.resumable.Resumable, ``logger`` its
    MetricsLogger and ``result`` its TrainResult (a rollback rewinds its per-step lists); ``faults`` the run's fault
    plan (meshtron.resilience.faults; empty in a normal run)."""

    def __init__(
        self,
        train: TrainConfig,
        run: RunConfig,
        runtime: Runtime,
        resumable,
        logger,
        result,
        faults: Faults | None = None,
    ):
        self.steps, self.collective_timeout_s = train.steps, run.collective_timeout_s
        self.runtime, self.resumable, self.logger, self.result = runtime, resumable, logger, result
        self.restarts = restart_count()  # > 0: torchrun restarted the workers after a failure
        self.logged_before = last_logged_step(result.output_dir) if self.restarts and runtime.is_main else 0
        self.rollback = NonfiniteRollback(train.max_rollbacks) if train.on_nonfinite == "rollback" else None
        if self.rollback is not None:
            resumable.on_save = self.rollback.checkpoint_saved
        self.faults = faults or Faults()
        self.faults.wrap_checkpoints(resumable.checkpoints)
        self.signals = StopSignals()
        self.watchdog: HangWatchdog | None = None

    def resumed(self, resumed_from, start_step: int) -> None:
        """Say what a restarted run resumed (call once the checkpoint is loaded) and which partial saves went."""
        if self.restarts:
            self.logger.message(restart_message(self.restarts, resumed_from, start_step, self.logged_before))
        if self.resumable.checkpoints is not None:
            for name in self.resumable.checkpoints.removed_partial:
                self.logger.message(
                    f"meshtron: removed {name}, a save that did not complete (the run was stopped during it)"
                )

    def __enter__(self) -> RunGuard:
        self.signals.__enter__()
        # None in one process; a hang under NCCL leaves each rank's flight recorder in the run's output directory
        self.watchdog = start_watchdog(self.runtime, self.collective_timeout_s, self.result.output_dir)
        return self

    def __exit__(self, *exc) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.signals.__exit__(*exc)

    def _progress(self, step: int, phase: str = "step") -> None:
        if self.watchdog is not None:
            self.watchdog.progress(step, phase)

    def before_step(self, step: int) -> None:
        """At the start of 0-based ``step`` (and of the fault plan's, which does nothing in a normal run)."""
        self._progress(step + 1)
        self.faults.before_step(step + 1, self.runtime.rank)

    def evaluating(self, step: int) -> None:
        """Before the evaluation after ``step`` steps (the hang watchdog names it if a rank does not arrive)."""
        self._progress(step, "evaluating")

    def rolled_back(self, step: int, outcome, lr: float, start_step: int) -> int | None:
        """After 0-based ``step`` trained (``outcome``: its meshtron.train.step.StepResult): the step to go on from
        when it was non-finite and rolled back, else None."""
        if not (outcome.nonfinite and self.rollback is not None):
            return None
        loss, grad_norm = outcome.loss, outcome.grad_norm
        rolled_to, line = self.rollback.roll_back(step + 1, loss, grad_norm, self.resumable)
        self.logger.message(line)
        self.logger.log({"step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr, "rolled_back_to": rolled_to})
        self.result.rewind(rolled_to - start_step)
        return rolled_to

    def metrics(self) -> dict:
        """Fields of each metrics row: which restart and how many rollbacks it comes after."""
        rollbacks = self.rollback.total if self.rollback is not None else 0
        return {
            **({"restart": self.restarts} if self.restarts else {}),
            **({"rollbacks": rollbacks} if rollbacks else {}),
        }

    def step_flags(self) -> list[int]:
        """This rank's flags for the step's all-reduce (meshtron.train.step.train_step's ``shared_flags``, read just
        before it): one per stop signal received, and an async save this rank still writes."""
        return [*self.signals.flags(), self.resumable.unfinished_save()]

    def after_step(self, step: int, flag_sums) -> None:
        """After ``step`` steps are done (``flag_sums``: ``step_flags`` summed over the ranks in that step): save
        when due or stopped; raise Preempted after a stop's save."""
        last = self.steps
        signals, unfinished = flag_sums[: len(STOP_SIGNALS)], flag_sums[len(STOP_SIGNALS)]
        stop = self.signals.agreed(signals) if step < last else None
        if stop or self.resumable.save_due(step):
            self._progress(step, "saving a checkpoint")
            self.resumable.save(step, stopped_by=stop)
        else:
            self.resumable.commit_if_done(unfinished)
        if stop:
            self.resumable.wait()
            raise Preempted(stop_message(stop, step, last, step_dir_name(step)))

    def finish(self, step: int) -> None:
        """After the last step: wait for an async save in flight."""
        self._progress(step, "saving a checkpoint")
        self.resumable.wait()
