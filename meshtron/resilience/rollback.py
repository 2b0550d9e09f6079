"""``train.on_nonfinite=rollback``: back to the last checkpoint after a non-finite step, without its batch.

A step whose loss or gradient norm is NaN/Inf (on any rank: both are global values) does not update the
model; instead every rank reloads the newest complete checkpoint and leaves the global batch of that step
out of the data order from then on (``GlobalBatchSchedule.skip``), so the steps after it are those of a run
given ``data.skip_batches=[that batch]`` from the start. The checkpoints saved afterwards record the skipped
batches (``data.skip_batches`` in meshtron.json), so a resumed run keeps skipping them. ``train.max_rollbacks``
rollbacks without a new checkpoint between them end the run with an error: the divergence is not the batch's
doing.
"""

from __future__ import annotations

from meshtron.checkpoint.manager import find_checkpoint
from meshtron.errors import MeshtronError


class NonfiniteRollback:
    """Counts rollbacks in a row and performs one (see the module docstring)."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def checkpoint_saved(self) -> None:
        self.in_a_row = 0

    def roll_back(self, step: int, loss: float, grad_norm: float, resumable) -> tuple[int, str]:
        """After 1-based ``step`` was non-finite: reload (a meshtron.train.run.resumable.Resumable) and skip its
        batch; returns (the checkpoint's step, a log line)."""
        what = f"step {step}: loss is {loss} and gradient norm is {grad_norm}"
        if self.in_a_row >= self.max_in_a_row:
            raise MeshtronError(
                f"{what} after {self.in_a_row} rollback(s) in a row (train.max_rollbacks={self.max_in_a_row}): the run "
                "keeps diverging whatever batches it skips; lower optimizer.lr, raise schedule.warmup_steps or check "
                "the data"
            )
        resumable.wait()  # an async save in flight is the newest checkpoint once complete
        path = find_checkpoint(resumable.checkpoints.directory, "auto")
        if path is None:
            raise MeshtronError(
                f"{what}; train.on_nonfinite=rollback has no checkpoint to go back to yet (the first is saved at step "
                "checkpoint.interval); lower checkpoint.interval or use train.on_nonfinite=skip"
            )
        bad_batch = resumable.schedule.batch_number(step - 1)
        meta = resumable.restore(path)
        resumable.schedule.skip([bad_batch])
        self.in_a_row += 1
        self.total += 1
        return meta["step"], (
            f"meshtron: {what}: rolled back to {path.name} (step {meta['step']}); global batch {bad_batch} is left out "
            f"of the data order (rollback {self.in_a_row} in a row of at most train.max_rollbacks={self.max_in_a_row})"
        )
