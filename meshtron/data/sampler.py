"""The global sample order: which packed sequences make up each global batch."""

from __future__ import annotations

import numpy as np


class GlobalBatchSchedule:
    """Deterministic order of packed sequences, as a series of epochs.

    Epoch ``e`` is ``default_rng([seed, e]).permutation(num_samples)`` (or ``arange`` without
    shuffling); global sample position ``p`` is element ``p % num_samples`` of epoch
    ``p // num_samples``. Step ``k`` uses positions ``[k * G, (k + 1) * G)``, so the data position
    is simply ``step * global_batch_size``: no sampler state needs saving, and a run resumes on
    the same sequences under any data-parallel layout.

    ``skipped_batches`` (``data.skip_batches``, and what ``train.on_nonfinite=rollback`` adds) are global
    batches numbered from 1 that the order leaves out: step ``k`` then trains the ``k``-th batch not skipped.
    """

    def __init__(self, num_samples: int, global_batch_size: int, shuffle: bool, seed: int):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None
        self.skipped_batches: set[int] = set()

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
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._cached = (epoch, order.astype(np.int64))
        return self._cached[1]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sequence indices at global positions ``[start, start + count)``, crossing epochs as needed."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        parts = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(self.num_samples - offset, end - pos)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            pos += take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def global_batch(self, step: int) -> np.ndarray:
        """The ``global_batch_size`` sequence indices of optimizer step ``step``."""
        return self.indices((self.batch_number(step) - 1) * self.global_batch_size, self.global_batch_size)

    def local_micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[np.ndarray]:
        """Rank ``dp_rank``'s micro-batches of step ``step``: its slice of each global micro-batch.

        The global batch is cut into ``A = global_batch_size / (dp_size x micro_batch_size)`` global
        micro-batches of ``dp_size x micro_batch_size`` consecutive sequences; accumulation step ``i`` of
        every rank processes global micro-batch ``i``, rank ``r`` its ``r``-th slice of ``micro_batch_size``.
        So the sequences processed together at an accumulation step are the same whatever ``dp_size`` (the
        ``i``-th ``A``-th of the global batch), as the router load-balancing loss, a mean over each global
        micro-batch, needs (meshtron.train.router_loss); a one-process run with the same ``A`` has them in
        its micro-batches.
        """
        g = self.global_batch_size
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_size}")
        if g % dp_size:
            raise ValueError(f"global batch size {g} is not divisible by the data-parallel size {dp_size}")
        per_rank = g // dp_size
        if micro_batch_size < 1 or per_rank % micro_batch_size:
            raise ValueError(f"{per_rank} sequences per rank are not divisible by micro-batch size {micro_batch_size}")
        batch = self.global_batch(step)
        group = dp_size * micro_batch_size  # one global micro-batch
        offset = dp_rank * micro_batch_size
        return [batch[start + offset : start + offset + micro_batch_size] for start in range(0, g, group)]
