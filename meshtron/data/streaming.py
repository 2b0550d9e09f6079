"""Streaming a source too large to prepare (``data.streaming=true``): documents read in order from a ``datasets``
iterable dataset, tokenized and packed while training runs, split across data-parallel ranks, with a position
that checkpoints save.

Lanes. The G positions of a global batch (``train.global_batch_size``) are G lanes. Lane ``j`` is a stream of
packed sequences of ``seq_len + 1`` tokens, and global batch ``n`` (0-based) holds sequence ``n`` of every lane,
lane ``j`` at position ``j``. Documents are dealt to lanes in stream order, each to the lane that has been dealt the
fewest characters so far (ties to the lowest lane), and a lane packs its documents (tokens + EOS) back to back. All
of this depends on the stream and G only, so a global batch holds the same sequences under every layout. A
data-parallel rank owns the lanes of its positions and tokenizes only their documents; every rank reads the
whole raw stream (the character count, not the tokens, decides the lane), which costs reading, not tokenizing.

Position. A lane's state before its sequence ``n`` is (``document``, ``offset``): its documents before index
``document`` are used up, and ``offset`` tokens of its first document at or after it are too. A reader snapshot
is the stream's own ``state_dict()`` (datasets) with the documents read and the characters dealt to each lane,
taken every ``SNAPSHOT_EVERY`` documents. A checkpoint holds, from each rank, its lanes' states for the next
global batch and a snapshot no later than their documents (``data-stream-rank<r>.json``). A resume under any
layout with the same G gathers its lanes' states from those files, reads on from a snapshot no later than its
lanes' documents, and drops what they had used: it continues exactly.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from meshtron.config import BUILTIN_CORPUS, DataConfig
from meshtron.data.dataset import inputs_and_labels
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.sources import (
    DATA_EXTRA,
    JSON_EXTENSIONS,
    _field_error,
    _folder_files,
    _is_saved_dataset,
    _load_saved,
    _stdlib_files,
)
from meshtron.errors import ConfigError, MeshtronError, import_extra

SNAPSHOT_EVERY = 256
"""Documents between two reader snapshots: a resume re-reads at most this many more raw documents."""
KEEP_SEQUENCES = 4
"""Sequences back a lane can still go without a checkpoint (the step read ahead, a rollback's stale read)."""
STATE_FILE = "data-stream-rank{rank}.json"
STATE_GLOB = "data-stream-rank*.json"
STATE_VERSION = 1


def open_stream(path: str, text_field: str):
    """(a ``datasets.IterableDataset`` over ``path`` in a fixed order, the name of its text column)."""
    datasets = import_extra("datasets", needed_by="data.streaming", extra=DATA_EXTRA)

    local = Path(path).expanduser()
    if path == BUILTIN_CORPUS:
        files, kind, field = [str(f) for f in _stdlib_files()], "text", "text"
    elif _is_saved_dataset(local):
        dataset = _load_saved(local).to_iterable_dataset()
        return _with_column(dataset, text_field, str(local)), text_field
    elif local.exists():
        files = [str(f) for f in (_folder_files(local) if local.is_dir() else [local])]
        kinds = {
            "json" if f.lower().endswith(JSON_EXTENSIONS) else "parquet" if f.lower().endswith(".parquet") else "text"
            for f in files
        }
        if len(kinds) != 1:
            raise ConfigError(
                f"data.path: '{path}' mixes {' and '.join(sorted(kinds))} files, which data.streaming "
                "reads with different readers; stream one kind of file per folder"
            )
        kind = kinds.pop()
        field = "text" if kind == "text" else text_field
    else:
        try:
            dataset = datasets.load_dataset(path, split="train", streaming=True)
        except Exception as err:  # noqa: BLE001 - any loader failure is a bad data.path for the user
            raise ConfigError(
                f"data.path: could not stream hub dataset '{path}' ({type(err).__name__}: {err}); "
                "check the name and network, or point data.path at local files"
            ) from None
        return _with_column(dataset, text_field, f"hub dataset '{path}'"), text_field
    # A text file is one document, as the prepared path reads it (the "text" loader's sample_by="document").
    options = {"sample_by": "document", "encoding_errors": "replace"} if kind == "text" else {}
    dataset = datasets.load_dataset(kind, data_files=files, split="train", streaming=True, **options)
    return _with_column(dataset, field, path), field


def _with_column(dataset, field: str, where: str):
    columns = dataset.column_names
    if columns is not None and field not in columns:
        raise _field_error(field, where, columns)
    return dataset.select_columns([field])


class DocumentReader:
    """One rank's pass over the raw stream: documents in order, each dealt to a lane, and position snapshots.

    ``open`` makes a fresh ``datasets.IterableDataset`` (read again from the start each epoch); ``max_documents``
    ends an epoch after that many non-empty documents."""

    _dataset: Any  # the open datasets.IterableDataset, None before ``open`` and after ``seek``

    def __init__(self, open: Callable, field: str, lanes: int, max_documents: int | None = None, where: str = ""):
        self.open, self.field, self.max_documents, self.where = open, field, max_documents, where
        self.seek({"document": 0, "epoch": 0, "in_epoch": 0, "stream": None, "chars": [0] * lanes})

    def snapshot(self) -> dict:
        return {
            "document": self.document,
            "epoch": self.epoch,
            "in_epoch": self.in_epoch,
            "stream": self._dataset.state_dict() if self._dataset is not None else self._stream_state,
            "chars": self.chars.tolist(),
        }

    def seek(self, snapshot: dict) -> None:
        """Continue from a snapshot (this reader's or another rank's)."""
        self.document, self.epoch, self.in_epoch = snapshot["document"], snapshot["epoch"], snapshot["in_epoch"]
        self.chars = np.asarray(snapshot["chars"], dtype=np.int64)
        self._stream_state, self._dataset, self._rows = snapshot["stream"], None, None
        self.snapshots = [dict(snapshot)]

    def next(self) -> tuple[int, int, str]:
        """(document index, lane, text) of the next non-empty document."""
        while True:
            if self._rows is None:
                self._dataset = self.open()
                if self._stream_state is not None:
                    self._dataset.load_state_dict(self._stream_state)
                self._rows = iter(self._dataset)
            full = self.max_documents is not None and self.in_epoch >= self.max_documents
            row = None if full else next(self._rows, None)
            if row is None:  # the end of an epoch: read the stream again from its start
                if self.in_epoch == 0:
                    raise MeshtronError(
                        f"data.path '{self.where}' gave no documents to stream; check data.path and data.text_field"
                    )
                self.epoch, self.in_epoch = self.epoch + 1, 0
                self._stream_state, self._dataset, self._rows = None, None, None
                continue
            text = row[self.field]
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.text_field: '{self.field}' in {self.where} is {type(text).__name__}, not "
                    "text; pick a text field"
                )
            lane = int(np.argmin(self.chars))
            self.chars[lane] += len(text)
            index = self.document
            self.document += 1
            self.in_epoch += 1
            if self.document % SNAPSHOT_EVERY == 0:
                self.snapshots.append(self.snapshot())
            return index, lane, text

    def forget_before(self, document: int) -> None:
        """Drop the snapshots that no resume from ``document`` on needs (all but the newest at or before it)."""
        keep = max((i for i, s in enumerate(self.snapshots) if s["document"] <= document), default=0)
        del self.snapshots[:keep]

    def snapshot_at_or_before(self, document: int) -> dict:
        return max((s for s in self.snapshots if s["document"] <= document), key=lambda s: s["document"])


class Lane:
    """One lane of sequences: its queue of dealt documents, the tokens of the one being cut, and its state history."""

    def __init__(self, sequence: int = 0, document: int = 0, offset: int = 0):
        self.sequence = sequence
        """The next sequence this lane gives (the number of the global batch it belongs to)."""
        self.start, self.offset = document, offset  # where it begins: its first document at or after ``start``
        self.queue: deque = deque()  # (index, text) dealt to it and not yet tokenized
        self.ready: deque = deque()  # (index, tokens) tokenized and not yet cut
        self.current: int | None = None  # the index of the document in ``tokens``
        self.tokens: np.ndarray = np.zeros(0, dtype=np.int64)
        self.position = 0
        self.history: dict[int, tuple[int, int]] = {}  # sequence -> state before it

    def state(self) -> tuple[int, int]:
        """(document, offset) before the next sequence."""
        if self.current is None:
            return self.start, self.offset
        if self.position < len(self.tokens):
            return self.current, self.position
        return self.current + 1, 0

    def wants(self, index: int) -> bool:
        return index >= self.start

    def next_sequence(self, width: int, tokenize: Callable, deal_one: Callable) -> np.ndarray:
        self.history[self.sequence] = self.state()
        self.history.pop(self.sequence - KEEP_SEQUENCES, None)
        parts, need = [], width
        while need:
            if self.position >= len(self.tokens):
                if not self.ready:  # tokenize everything queued in one call
                    while not self.queue:
                        deal_one()
                    indices, texts = zip(*self.queue)
                    self.queue.clear()
                    self.ready.extend(zip(indices, tokenize(list(texts))))
                self.current, self.tokens = self.ready.popleft()
                self.position, self.offset = self.offset, 0  # the saved offset is into the first document
                continue
            take = min(need, len(self.tokens) - self.position)
            parts.append(self.tokens[self.position : self.position + take])
            self.position += take
            need -= take
        self.sequence += 1
        return np.concatenate(parts)


class StreamingDataset:
    """Packed sequences of ``data.seq_len + 1`` tokens streamed from ``data.path`` (see the module docstring).

    Sequence ``index`` is sequence ``index // G`` of lane ``index % G``; ``rows`` gives them (each lane in order; a
    lane skips ahead, or goes back up to KEEP_SEQUENCES sequences). Thread-safe: the prefetch thread reads while the
    main thread saves or restores."""

    def __init__(self, data: DataConfig, tokenizer, global_batch_size: int):
        self.path, self.seq_len, self.lane_count = data.path, data.seq_len, global_batch_size
        self.tokenizer_name, self.eos = tokenizer.name, tokenizer.eos_token_id
        self.shuffle = data.shuffle
        self._encode = tokenizer.encode_batch
        field = open_stream(data.path, data.text_field)[1]  # checks the source and its column once, up front
        self.reader = DocumentReader(
            lambda: open_stream(data.path, data.text_field)[0], field, global_batch_size, data.max_documents, data.path
        )
        self.lanes: dict[int, Lane] = {}
        self.tokenized_documents = 0
        self._lock = threading.Lock()

    def own(self, positions: Iterable[int]) -> None:
        """The lanes this rank reads: the global-batch positions of its micro-batches (before any sequence is read)."""
        self.lanes = {int(p) % self.lane_count: Lane() for p in positions}

    def describe(self) -> str:
        order = " (its own order: data.shuffle does not apply)" if self.shuffle else ""
        return f"streamed from {self.path}{order} into {self.lane_count} lanes of {self.seq_len}-token sequences"

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        self.tokenized_documents += len(texts)
        return [np.append(np.asarray(ids, dtype=np.int64), self.eos) for ids in self._encode(texts)]

    def _deal_one(self) -> None:
        index, lane, text = self.reader.next()
        owner = self.lanes.get(lane)
        if owner is not None and owner.wants(index):
            owner.queue.append((index, text))

    def rows(self, indices) -> np.ndarray:
        """The sequences ``indices`` (``sequence * G + lane``) as an int64 array (len(indices), seq_len + 1)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        with self._lock:
            sequences, lanes = np.divmod(indices, self.lane_count)
            missing = sorted(set(lanes.tolist()) - set(self.lanes))
            if missing:
                raise MeshtronError(f"streamed lanes {missing} are not this rank's (own() names the lanes it reads)")
            behind = [int(n) for n, j in zip(sequences, lanes) if n < self.lanes[int(j)].sequence]
            if behind:
                self._rewind(min(behind))
            out = np.empty((indices.size, self.seq_len + 1), dtype=np.int64)
            for row, (sequence, lane_index) in enumerate(zip(sequences.tolist(), lanes.tolist())):
                lane = self.lanes[lane_index]
                while lane.sequence < sequence:  # skipped batches (data.skip_batches, rollbacks)
                    lane.next_sequence(self.seq_len + 1, self._tokenize, self._deal_one)
                out[row] = lane.next_sequence(self.seq_len + 1, self._tokenize, self._deal_one)
            self.reader.forget_before(
                min(min([*lane.history.values(), lane.state()])[0] for lane in self.lanes.values())
            )
            return out

    def batch(self, indices):
        return inputs_and_labels(self.rows(indices))

    def target_count(self, indices) -> int:
        """Labelled tokens of sequences ``indices``: every token after a sequence's first (text has no masked
        labels), so any rank counts the whole global batch without reading the lanes of others."""
        return len(indices) * self.seq_len

    def _lane_state(self, lane: Lane, batch: int) -> list[int]:
        """[sequence, document, offset]: the lane's state before its sequence ``batch`` (that of global batch
        ``batch``), or before its next one if that is earlier."""
        if lane.sequence <= batch:
            return [lane.sequence, *lane.state()]
        if batch not in lane.history:
            raise MeshtronError(
                f"the streamed data's position before batch {batch + 1} is no longer known "
                f"(lanes are at batch {lane.sequence + 1})"
            )
        return [batch, *lane.history[batch]]

    def _position(self, batch: int) -> dict:
        lanes = {str(j): self._lane_state(lane, batch) for j, lane in self.lanes.items()}
        first = min(document for _, document, _ in lanes.values())
        return {"lanes": lanes, "snapshot": self.reader.snapshot_at_or_before(first)}

    def state(self, batch: int) -> dict:
        """This rank's position before global batch ``batch`` (0-based): what a checkpoint saves."""
        with self._lock:
            return {
                "version": STATE_VERSION,
                "path": self.path,
                "tokenizer": self.tokenizer_name,
                "lanes_total": self.lane_count,
                "seq_len": self.seq_len,
                **self._position(batch),
            }

    def _rewind(self, batch: int) -> None:
        self._restore([self._position(batch)])

    def restore(self, states: list[dict]) -> None:
        """Continue from the states that the ranks of a checkpoint saved (any layout with the same G)."""
        for state in states:
            if state.get("version") != STATE_VERSION or state["lanes_total"] != self.lane_count:
                raise ConfigError(
                    f"the checkpoint's streamed data position is of {state.get('lanes_total')} lanes "
                    f"(train.global_batch_size), not {self.lane_count}; resume with that batch size"
                )
            if state["path"] != self.path or state["tokenizer"] != self.tokenizer_name:
                raise ConfigError(
                    f"the checkpoint streamed data.path '{state['path']}' with tokenizer "
                    f"'{state['tokenizer']}'; resume with those (this run has '{self.path}', "
                    f"'{self.tokenizer_name}')"
                )
        with self._lock:
            self._restore(states)

    def _restore(self, states: list[dict]) -> None:
        saved = {}
        for state in states:
            saved.update({int(j): value for j, value in state["lanes"].items()})
        missing = sorted(set(self.lanes) - set(saved))
        if missing:
            raise MeshtronError(f"the checkpoint holds no streamed position for lanes {missing[:8]}; it is incomplete")
        first = min(saved[j][1] for j in self.lanes)
        snapshot = max(
            (s["snapshot"] for s in states if s["snapshot"]["document"] <= first), key=lambda s: s["document"]
        )
        self.reader.seek(snapshot)
        self.lanes = {j: Lane(*saved[j]) for j in self.lanes}


class StreamSchedule(GlobalBatchSchedule):
    """The order of streamed sequences: global batch ``n`` is sequences ``n * G .. n * G + G - 1`` (lane j at position
    j)."""

    def __init__(self, global_batch_size: int, seed: int = 0):
        super().__init__(1, global_batch_size, False, seed)

    def indices(self, start: int, count: int) -> np.ndarray:
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        return np.arange(start, start + count, dtype=np.int64)


def save_stream_state(dataset: StreamingDataset, batch: int, rank: int) -> dict[str, str]:
    """The file this rank adds to a checkpoint: its lanes' position before global batch ``batch``."""
    return {STATE_FILE.format(rank=rank): json.dumps(dataset.state(batch))}


def load_stream_states(checkpoint: Path) -> list[dict]:
    """The streamed positions every rank of checkpoint ``checkpoint`` saved."""
    files = sorted(Path(checkpoint).glob(STATE_GLOB))
    if not files:
        raise ConfigError(
            f"checkpoint '{checkpoint}' was saved without data.streaming, so it holds no stream "
            "position; resume it with data.streaming=false"
        )
    return [json.loads(f.read_text()) for f in files]


def check_stream_checkpoint(checkpoint: Path | None, streaming: bool) -> None:
    """Refuse, before any collective, a resume that would change between streamed and indexed data."""
    if checkpoint is None:
        return
    saved_streaming = any(Path(checkpoint).glob(STATE_GLOB))
    if streaming and not saved_streaming:
        load_stream_states(checkpoint)
    if saved_streaming and not streaming:
        raise ConfigError(
            f"checkpoint '{checkpoint}' was saved with data.streaming=true: its data position is a "
            "stream's; resume it with data.streaming=true"
        )
