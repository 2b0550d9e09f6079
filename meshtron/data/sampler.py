"""The global sample order: which packed sequences make up each global batch."""

from __future__ import annotations

import numpy as np


class BatchSizes:
    """How many sequences each global batch (numbered from 1) holds, and where in the data order it starts.

    ``final`` (``train.global_batch_size``) throughout, or with ``rampup`` = (START, STEPS) (``train.batch_rampup``)
    START sequences at first, growing in steps of START to ``final`` over STEPS optimizer steps: batch ``k + 1``
    holds ``START * min(final / START, 1 + k * (final / START - 1) // STEPS)``. The sizes depend on the settings
    only, never on the layout. Batches follow one another in the data order; ``rebase`` (a resumed checkpoint) makes
    the batches after the checkpoint's last one start where it stopped, whatever the batch size it was saved with.
    """

    def __init__(self, final: int, rampup: tuple[int, int] | None = None):
        if final < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {final}")
        self.final = final
        ramp = []
        if rampup is not None:
            start, steps = rampup
            multiples = final // start
            ramp = [start * min(multiples, 1 + k * (multiples - 1) // steps) for k in range(steps)]
        self._ramp = np.asarray(ramp, dtype=np.int64)
        self._ramp_starts = np.concatenate([[0], np.cumsum(self._ramp)]).astype(np.int64)
        self.base_batch, self.base_position = 0, 0

    def size(self, batch: int) -> int:
        """Sequences of global batch ``batch`` (from 1)."""
        return int(self._ramp[batch - 1]) if batch - 1 < len(self._ramp) else self.final

    def _from_first(self, batch: int) -> int:
        """Sequences of the batches before ``batch``."""
        done = batch - 1
        if done <= len(self._ramp):
            return int(self._ramp_starts[done])
        return int(self._ramp_starts[-1]) + (done - len(self._ramp)) * self.final

    def start(self, batch: int) -> int:
        """Position in the data order of the first sequence of global batch ``batch``."""
        if batch <= self.base_batch:
            raise ValueError(f"global batch {batch} comes before the resumed position (after batch {self.base_batch})")
        return self.base_position + self._from_first(batch) - self._from_first(self.base_batch + 1)

    def rebase(self, batch: int, position: int) -> None:
        """The batches after ``batch`` start at ``position`` (what a checkpoint saved after ``batch`` recorded)."""
        self.base_batch, self.base_position = int(batch), int(position)


def epoch_permutation(count: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order of ``count`` sequences in epoch ``epoch``: ``default_rng([seed, epoch]).permutation(count)``, or
    ``arange`` without shuffling."""
    if shuffle:
        return np.random.default_rng([seed, epoch]).permutation(count).astype(np.int64)
    return np.arange(count, dtype=np.int64)


def epoch_position(carry, position: int, count: int) -> int:
    """Where data-order ``position``, after the carry ``carry`` (meshtron.data.carry.Carry, or None), falls in the run
    of whole epochs of ``count`` sequences: ``epoch * count + offset``."""
    if carry is None:
        return position
    if position < carry.end:
        raise ValueError(f"position {position} is inside the carry [{carry.start}, {carry.end})")
    return position - carry.end + carry.next_epoch * count


class GlobalBatchSchedule:
    """Deterministic order of packed sequences, as a series of epochs.

    Epoch ``e`` is ``default_rng([seed, e]).permutation(num_samples)`` (or ``arange`` without
    shuffling); global sample position ``p`` is element ``p % num_samples`` of epoch
    ``p // num_samples``. Step ``k`` uses positions ``[k * G, (k + 1) * G)``, so the data position
    is simply ``step * global_batch_size``: no sampler state needs saving, and a run resumes on
    the same sequences under any data-parallel layout.

    With ``sizes`` (BatchSizes: a batch size rampup, or a resume with another batch size) batch ``n`` starts at
    ``sizes.start(n)`` instead.

    ``skipped_batches`` (``data.skip_batches``, and what ``train.on_nonfinite=rollback`` adds) are global
    batches numbered from 1 that the order leaves out: step ``k`` then trains the ``k``-th batch not skipped.

    ``carry`` (meshtron.data.carry, a resume with another ``data.seq_len``): positions ``[carry.start, carry.end)``
    are the carried sequences, numbered ``num_samples + j`` (the dataset reads them), and whole epochs follow from
    epoch ``carry.next_epoch`` on.
    """

    def __init__(
        self, num_samples: int, global_batch_size: int, shuffle: bool, seed: int, sizes: BatchSizes | None = None
    ):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.sizes = sizes or BatchSizes(global_batch_size)
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None
        self.skipped_batches: set[int] = set()
        self.carry = None

    def skip(self, batches) -> None:
        """Leave these global batches (numbered from 1) out of the order from now on."""
        self.skipped_batches.update(int(batch) for batch in batches)

    def batch_number(self, step: int) -> int:
        """The global batch (numbered from 1) that 0-based optimizer step ``step`` trains on."""
        number = step + 1
        for skipped in sorted(self.skipped_batches):
            if skipped <= number:
                number += 1
        return number

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sequence order of one epoch (the latest one asked for is cached)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_permutation(self.num_samples, self.shuffle, self.seed, epoch))
        return self._cached[1]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sequence indices at global positions ``[start, start + count)``, crossing epochs as needed."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        parts = []
        pos, end = start, start + count
        carry = self.carry
        while pos < end:
            if carry is not None and pos < carry.end:
                if pos < carry.start:
                    raise ValueError(f"position {pos} comes before the resumed position {carry.start}")
                take = min(carry.end, end) - pos
                parts.append(self.num_samples + carry.order[pos - carry.start : pos - carry.start + take])
            else:
                epoch, offset = divmod(epoch_position(carry, pos, self.num_samples), self.num_samples)
                take = min(self.num_samples - offset, end - pos)
                parts.append(self.epoch_order(epoch)[offset : offset + take])
            pos += take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def global_batch(self, step: int) -> np.ndarray:
        """The sequence indices of optimizer step ``step`` (``sizes.size`` of them: ``global_batch_size`` without a
        rampup)."""
        batch = self.batch_number(step)
        return self.indices(self.sizes.start(batch), self.sizes.size(batch))

    def position_after(self, step: int) -> tuple[int, int]:
        """(the global batch the ``step``-th step trained, the data position after it), for a checkpoint saved after
        ``step`` steps: a run resumed from it goes on from there (BatchSizes.rebase) whatever its batch size."""
        last = self.batch_number(step - 1) if step > 0 else 0
        return last, self.sizes.start(last + 1)

    def local_micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[np.ndarray]:
        """Rank ``dp_rank``'s micro-batches of step ``step``: its slice of each global micro-batch.

        The global batch is cut into ``A = global_batch_size / (dp_size x micro_batch_size)`` global
        micro-batches of ``dp_size x micro_batch_size`` consecutive sequences; accumulation step ``i`` of
        every rank processes global micro-batch ``i``, rank ``r`` its ``r``-th slice of ``micro_batch_size``.
        So the sequences processed together at an accumulation step are the same whatever ``dp_size`` (the
        ``i``-th ``A``-th of the global batch), as the router load-balancing loss, a mean over each global
        micro-batch, needs (meshtron.train.moe.router_loss); a one-process run with the same ``A`` has them in
        its micro-batches.
        """
        batch = self.global_batch(step)
        g = len(batch)
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_size}")
        if g % dp_size:
            raise ValueError(f"global batch size {g} is not divisible by the data-parallel size {dp_size}")
        per_rank = g // dp_size
        if micro_batch_size < 1 or per_rank % micro_batch_size:
            raise ValueError(f"{per_rank} sequences per rank are not divisible by micro-batch size {micro_batch_size}")
        group = dp_size * micro_batch_size  # one global micro-batch
        offset = dp_rank * micro_batch_size
        return [batch[start + offset : start + offset + micro_batch_size] for start in range(0, g, group)]
