"""Step inputs read ahead: while step k trains, a background thread reads step k + 1's micro-batches.

The main thread decides which sequences a step reads (the schedule is only touched there, so a rollback that
changes it cannot race with the thread); the thread reads them from the memory-mapped corpus into int64
tensors (pinned on CUDA, so that the step's copies to the device are non-blocking) and counts the global batch's
labelled tokens. A read ahead is used only if the step asks for exactly the sequences it read, so skipping
batches or going back to a checkpoint re-reads; the inputs, and so the results, are the same with
``data.prefetch`` on or off.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch


@dataclass
class StepInputs:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    """(input_ids, labels) int64 tensors on the host, one pair per micro-batch of this rank."""
    global_targets: int
    """Labelled tokens of the whole global batch (every rank counts them itself)."""
    pair_counts: Any = None
    """A preference objective's counts of the global batch (``StepReader``'s ``count_pairs``), else None."""
    references: list[torch.Tensor] | None = None
    """With ``StepReader``'s ``references``: each micro-batch's (B, 2) precomputed reference log-probabilities."""


@dataclass(frozen=True)
class StepSequences:
    """Which packed sequences a step reads: this rank's micro-batches and the whole global batch."""

    micro_batches: tuple[np.ndarray, ...]
    global_batch: np.ndarray

    def same_as(self, other: StepSequences) -> bool:
        return (
            len(self.micro_batches) == len(other.micro_batches)
            and np.array_equal(self.global_batch, other.global_batch)
            and all(np.array_equal(a, b) for a, b in zip(self.micro_batches, other.micro_batches))
        )


class StepReader:
    """``get(step)``: the inputs of a step, read ahead by one step when ``prefetch`` is on.

    ``sequences(step)`` says which sequences a step reads (a StepSequences); ``dataset`` is the PackedDataset;
    ``count_targets(dataset, indices)`` counts labelled tokens (meshtron.train.step_stats.global_target_count);
    ``pin`` pins the host tensors (for non-blocking copies to a GPU); ``count_pairs(dataset, indices)``: a
    preference objective's counts of the global batch (meshtron.train.preference.targets.PairCounts);
    ``references``: read each micro-batch's precomputed reference log-probabilities too
    (``dataset.reference_rows``: meshtron.data.reference_logps).
    """

    def __init__(
        self,
        dataset,
        sequences: Callable[[int], StepSequences],
        count_targets: Callable,
        *,
        prefetch: bool = True,
        pin: bool = False,
        count_pairs: Callable | None = None,
        references: bool = False,
    ):
        self.dataset, self.sequences, self.count_targets, self.pin = dataset, sequences, count_targets, pin
        self.count_pairs, self.references = count_pairs, references
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshtron-prefetch") if prefetch else None
        self._ahead: tuple[int, StepSequences, Future] | None = None

    def read(self, sequences: StepSequences) -> StepInputs:
        pairs = []
        for indices in sequences.micro_batches:
            input_ids, labels = self.dataset.batch(indices)
            pairs.append((input_ids.pin_memory(), labels.pin_memory()) if self.pin else (input_ids, labels))
        counts = self.count_pairs(self.dataset, sequences.global_batch) if self.count_pairs is not None else None
        references = [self.dataset.reference_rows(i) for i in sequences.micro_batches] if self.references else None
        return StepInputs(pairs, self.count_targets(self.dataset, sequences.global_batch), counts, references)

    def get(self, step: int) -> StepInputs:
        wanted = self.sequences(step)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step and ahead[1].same_as(wanted):
            inputs = ahead[2].result()
        else:
            if ahead is not None:
                ahead[2].cancel()
            inputs = self.read(wanted)
        if self._pool is not None:
            following = self.sequences(step + 1)
            self._ahead = (step + 1, following, self._pool.submit(self.read, following))
        return inputs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
