"""Weighted mixtures of corpora (``data.sources``): which source each sample of the global order comes from.

Source ``s`` with weight ``w_s`` (weights normalized to sum 1) owns the "virtual times" ``(k + phase_s) / w_s``
for its ``k``-th sample, ``k = 0, 1, ...``, with a phase in [0, 1) drawn from ``data.seed``. Sample positions of
the global order take these times in increasing order (ties by source index), so after ``p`` positions every
source has given ``w_s * p`` samples, give or take one: the fractions hold in every window, not only on average.
The ``k``-th sample of source ``s`` is element ``k`` of that source's own epochs (each a permutation seeded by
``data.seed`` and the source, as meshtron.data.sampler does for one corpus). Everything is a function of the
seed, the weights and the position, so a step trains the same sequences under every layout and after a
resume under another one; nothing needs saving. Sources are addressed as one index space: source ``s``'s
sequences come after those of the sources before it (``MixedDataset``).
"""

from __future__ import annotations

import numpy as np

from meshtron.data.dataset import inputs_and_labels
from meshtron.data.sampler import BatchSizes, GlobalBatchSchedule
from meshtron.errors import ConfigError


def parse_sources(sources: list[str]) -> list[tuple[str, float]]:
    """``["DIR:WEIGHT", ...]`` -> [(DIR, weight normalized to sum 1)]."""
    parsed = []
    for item in sources:
        path, _, weight = str(item).rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not path or not value > 0:
            raise ConfigError(f"data.sources: {item!r} is not PATH:WEIGHT with a positive weight (e.g. /data/web:0.7)")
        parsed.append((path, value))
    total = sum(weight for _, weight in parsed)
    return [(path, weight / total) for path, weight in parsed]


class MixtureSchedule(GlobalBatchSchedule):
    """The global order over several sources (see the module docstring); ``sizes`` are their sequence counts."""

    def __init__(
        self,
        sizes: list[int],
        weights: list[float],
        global_batch_size: int,
        shuffle: bool,
        seed: int,
        batch_sizes: BatchSizes | None = None,
    ):
        super().__init__(sum(sizes), global_batch_size, shuffle, seed, batch_sizes)
        if len(sizes) != len(weights) or min(sizes) < 1:
            raise ValueError(f"every source needs at least one sequence: {sizes}")
        self.weights = np.asarray(weights, dtype=np.float64)
        self.phases = np.random.default_rng([seed, 1 << 20]).random(len(sizes))
        self.offsets = np.cumsum([0] + list(sizes[:-1]))
        self.sources = [GlobalBatchSchedule(size, 1, shuffle, seed + 7919 * (i + 1)) for i, size in enumerate(sizes)]

    def _taken(self, until: float) -> np.ndarray:
        """How many samples of each source have a virtual time <= ``until``."""
        return np.maximum(0, np.floor(self.weights * until - self.phases).astype(np.int64) + 1)

    def _next(self, taken: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of the ``count`` positions that follow once ``taken`` samples of each source are out."""
        ks = taken[:, None] + np.arange(count + 1)[None, :]
        times = (ks + self.phases[:, None]) / self.weights[:, None]
        source = np.broadcast_to(np.arange(len(taken))[:, None], ks.shape)
        order = np.lexsort((source.ravel(), times.ravel()))[:count]
        return source.ravel()[order], ks.ravel()[order]

    def counts_before(self, position: int) -> np.ndarray:
        """Samples each source has given in the first ``position`` positions of the order."""
        low, high = 0.0, (position + 1) / self.weights.min() + 1.0
        for _ in range(200):  # the largest time at which fewer than ``position`` samples are out
            middle = (low + high) / 2
            if self._taken(middle).sum() < position:
                low = middle
            else:
                high = middle
            if high - low < 1e-9 * max(1.0, high):
                break
        taken = self._taken(low)
        rest = position - int(taken.sum())
        if rest > 0:
            source, _ = self._next(taken, rest)
            taken = taken + np.bincount(source, minlength=len(taken))
        return taken

    def indices(self, start: int, count: int) -> np.ndarray:
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        source, ks = self._next(self.counts_before(start), count)
        sequences: np.ndarray = np.empty(count, dtype=np.int64)
        for s in np.unique(source):
            chosen = source == s
            run = ks[chosen]  # consecutive sample numbers of source s
            sequences[chosen] = self.offsets[s] + self.sources[s].indices(int(run[0]), len(run))
        return sequences


class MixedDataset:
    """Several PackedDatasets of one ``seq_len`` as one index space (source ``s`` after the sources before it)."""

    def __init__(self, datasets: list):
        self.datasets = datasets
        self.seq_len = datasets[0].seq_len
        self.sizes = [len(d) for d in datasets]
        self.starts = np.cumsum([0] + self.sizes)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def rows(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((indices.size, self.seq_len + 1), dtype=np.int64)
        source = np.searchsorted(self.starts, indices, side="right") - 1
        for s in np.unique(source):
            chosen = source == s
            out[chosen] = self.datasets[s].rows(indices[chosen] - self.starts[s])
        return out

    def batch(self, indices):
        return inputs_and_labels(self.rows(indices))
