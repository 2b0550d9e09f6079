"""Resuming with another ``data.seq_len``: the rest of the epoch, cut again into sequences of the new length.

A checkpoint records its data position in sequences of the length it trained with. A run resumed from it with
another ``data.seq_len`` first trains the *carry*: the tokens of the current epoch that no sequence trained so far
held, joined in stream order and cut into sequences of the new length (in a shuffled order when ``data.shuffle``),
and then whole epochs of sequences of the new length. Nothing of the epoch is trained twice, and nothing is left
out but the carry's last, incomplete sequence (fewer than ``seq_len + 1`` tokens, as every epoch leaves out the end
of the stream that does not fill a sequence). Where two untrained stretches of the stream meet, a carried sequence
holds tokens that were not neighbours in the corpus: one join per stretch.

Each change of ``data.seq_len`` is recorded in the checkpoints saved after it (``SEQ_LEN_CHANGES`` in meshtron.json:
the data position, the length before and the length after), and the carry is computed again from that record at
every resume. It depends on the settings and the record only, so every layout, and every later resume, reads the
same sequences. One corpus (``data.path``, prepared or cached) only: mixtures, chat data and streams refuse another
``data.seq_len`` (meshtron.checkpoint.manager.check_compatible).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtron.data.sampler import epoch_permutation, epoch_position

SEQ_LEN_CHANGES = "data.seq_len_changes"
"""meshtron.json's record of the run's changes of data.seq_len: [[position, seq_len before, seq_len after], ...]."""
CARRY_SEED = 1 << 21
"""Mixed into the seed of a carry's order, so that it is not the order of a whole epoch."""


@dataclass(frozen=True)
class Carry:
    """Positions ``[start, end)`` of the data order are the carried sequences (in ``order``); epoch ``next_epoch``
    of whole sequences follows from ``end`` on."""

    start: int
    intervals: np.ndarray
    """(K, 2) int64 ranges ``[a, b)`` of the dataset's token stream, ascending and apart: the untrained tokens."""
    width: int
    """Tokens of a carried sequence: ``data.seq_len + 1``."""
    next_epoch: int
    order: np.ndarray
    """Carried sequence numbers in the order the positions take them."""
    offsets: np.ndarray
    """Where each interval starts in the concatenation of the intervals, and their total last (K + 1 values)."""

    @property
    def count(self) -> int:
        return len(self.order)

    @property
    def end(self) -> int:
        return self.start + self.count

    def sequence_ranges(self, number: int) -> np.ndarray:
        """The stream ranges that carried sequence ``number`` reads, in order (a look-up in ``offsets``: a step reads
        many sequences, and the intervals can be many)."""
        low, high = number * self.width, (number + 1) * self.width
        first = int(np.searchsorted(self.offsets, low, side="right")) - 1
        last = int(np.searchsorted(self.offsets, high, side="left"))  # the intervals [first, last) hold the sequence
        pieces = self.intervals[first:last].copy()
        pieces[0, 0] += low - self.offsets[first]
        pieces[-1, 1] -= self.offsets[last] - high
        return pieces


def merge_ranges(ranges: np.ndarray) -> np.ndarray:
    """Sorted, non-overlapping ``[a, b)`` ranges with the touching ones joined (empty ones dropped)."""
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    if len(ranges) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.concatenate([[True], ranges[1:, 0] != ranges[:-1, 1]])
    ends = np.concatenate([starts[1:], [True]])
    return np.stack([ranges[starts, 0], ranges[ends, 1]], axis=1).astype(np.int64)


def stream_ranges(intervals: np.ndarray, virtual: np.ndarray) -> np.ndarray:
    """Map ranges ``virtual`` (sorted, apart) of the concatenation of ``intervals`` to ranges of the stream."""
    if len(virtual) == 0 or len(intervals) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    lengths = intervals[:, 1] - intervals[:, 0]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # Cut the virtual ranges at every interval boundary: each piece then lies in one interval.
    points = np.unique(np.concatenate([virtual.ravel(), offsets]))
    pieces = np.stack([points[:-1], points[1:]], axis=1)
    inside = np.searchsorted(virtual[:, 0], pieces[:, 0], side="right") - 1
    keep = (inside >= 0) & (pieces[:, 1] <= virtual[np.maximum(inside, 0), 1])
    pieces = pieces[keep]
    interval = np.searchsorted(offsets, pieces[:, 0], side="right") - 1
    shift = intervals[interval, 0] - offsets[interval]
    return merge_ranges(pieces + shift[:, None])


def _untrained_sequences(trained: np.ndarray, count: int, width: int) -> np.ndarray:
    """Ranges of ``width``-token sequences ``0 .. count - 1`` that are not in ``trained`` (sequence numbers)."""
    free: np.ndarray = np.ones(count, dtype=bool)
    free[trained] = False
    edges = np.diff(np.concatenate([[0], free.astype(np.int8), [0]]))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1).astype(np.int64) * width


def carry_after(
    previous: Carry | None, old_width: int, new_width: int, position: int, stream_tokens: int, shuffle: bool, seed: int
) -> Carry:
    """The carry of a run that resumes at data-order ``position`` with sequences of ``new_width`` tokens, after
    sequences of ``old_width`` tokens (with the carry ``previous`` of an earlier change, or None)."""
    if previous is not None and previous.start <= position < previous.end:  # a change inside an earlier carry
        virtual = _untrained_sequences(previous.order[: position - previous.start], previous.count, old_width)
        tail = [[previous.count * old_width, int(previous.offsets[-1])]]
        virtual = merge_ranges(np.concatenate([virtual, tail]))
        intervals, next_epoch = stream_ranges(previous.intervals, virtual), previous.next_epoch
    else:
        count = stream_tokens // old_width
        epoch, offset = divmod(epoch_position(previous, position, count), count)
        trained = epoch_permutation(count, shuffle, seed, epoch)[:offset]
        tail = [[count * old_width, stream_tokens]]  # never in a sequence of the old length: untrained too
        intervals = merge_ranges(np.concatenate([_untrained_sequences(trained, count, old_width), tail]))
        next_epoch = epoch + 1
    offsets = np.concatenate([[0], np.cumsum(intervals[:, 1] - intervals[:, 0])]).astype(np.int64)
    order = epoch_permutation(int(offsets[-1]) // new_width, shuffle, seed + CARRY_SEED, next_epoch)
    return Carry(position, intervals, new_width, next_epoch, order, offsets)


def replay_changes(changes: list, stream_tokens: int, shuffle: bool, seed: int) -> Carry | None:
    """The carry in force after the recorded ``changes`` ([position, seq_len before, seq_len after], in order)."""
    carry = None
    for position, before, after in changes:
        carry = carry_after(carry, before + 1, after + 1, int(position), stream_tokens, shuffle, seed)
    return carry


def resume_with_changes(dataset, schedule, changes: list, shuffle: bool, seed: int) -> None:
    """Give ``dataset`` (a PackedDataset) and its ``schedule`` the carry of the recorded ``changes``."""
    dataset.carry = schedule.carry = replay_changes(changes, dataset.stream_tokens, shuffle, seed)
