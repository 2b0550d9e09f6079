"""The packed training dataset: sequences of ``seq_len + 1`` tokens cut from a prepared corpus at load time.

``data.path`` is either a directory made by ``meshtron data prepare`` (memory-mapped as it is) or any other
source, which is prepared once into ``data.cache_dir`` in the same format (meshtron.data.shards). The cache
does not depend on ``seq_len``, so another sequence length reuses it. One process per machine (local rank 0)
builds the cache; the others wait for it by watching the file system, not in a collective, so a long first
build never meets the collective timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from meshtron.config import DataConfig
from meshtron.data.carry import Carry
from meshtron.data.prepare import prepare_corpus
from meshtron.data.shards import MANIFEST, TokenCorpus, is_prepared, write_json_atomically
from meshtron.data.sources import source_fingerprint
from meshtron.errors import ConfigError, MeshtronError

CACHE_VERSION = 2
POLL_S = 1.0
"""Longest pause between two looks of a waiting process for the cache file (or the builder's failure)."""


class PackedDataset:
    """Packed sequences of ``seq_len + 1`` tokens: the rows of an array (num_sequences, seq_len + 1), or the
    consecutive windows of a prepared corpus's token stream (``from_corpus``; the remainder at the end is dropped)."""

    def __init__(self, sequences: np.ndarray, path: Path | None = None):
        if sequences.ndim != 2 or sequences.shape[1] < 2:
            raise ValueError(f"sequences must have shape (num_sequences, seq_len + 1), got {sequences.shape}")
        self._sequences: np.ndarray | None = sequences
        self._corpus: TokenCorpus | None = None
        self._start = 0
        self._len = sequences.shape[0]
        self.path = path
        self.seq_len = sequences.shape[1] - 1
        self.stream_tokens = self._len * (self.seq_len + 1)
        self.carry: Carry | None = None
        """meshtron.data.carry.Carry of a run resumed with another data.seq_len: sequences ``len(self) + j``."""

    @classmethod
    def from_corpus(
        cls, corpus: TokenCorpus, seq_len: int, path: Path | None = None, start: int = 0, stop: int | None = None
    ) -> PackedDataset:
        """The windows of tokens ``[start, stop)`` of the corpus's stream (all of it by default)."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        stop = corpus.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= corpus.num_tokens:
            raise ValueError(f"tokens [{start}, {stop}) outside the corpus's {corpus.num_tokens}")
        dataset = cls.__new__(cls)
        dataset._sequences, dataset._corpus, dataset._start = None, corpus, start
        dataset._len = (stop - start) // (seq_len + 1)
        dataset.path, dataset.seq_len = path, seq_len
        dataset.stream_tokens, dataset.carry = stop - start, None
        return dataset

    def split_documents(self, held_out: int, source: str = "") -> tuple[PackedDataset, PackedDataset]:
        """(the sequences before the corpus's last ``held_out`` documents, the sequences of those documents): no
        sequence of the first holds a token of the held-out documents (``eval.holdout_documents``). ``source``:
        the data.path the corpus was prepared from (for the error)."""
        if self._corpus is None or self._start:
            raise ValueError("split_documents needs a whole prepared corpus")
        ends = self._corpus.document_ends()
        if held_out >= len(ends):
            raise ConfigError(
                f"eval.holdout_documents={held_out} leaves nothing to train on: data.path '{source or self.path}' has "
                f"{len(ends)} documents; hold out fewer or set eval.path"
            )
        boundary = int(ends[-held_out - 1])
        kept = PackedDataset.from_corpus(self._corpus, self.seq_len, self.path, stop=boundary)
        held = PackedDataset.from_corpus(self._corpus, self.seq_len, self.path, start=boundary)
        return kept, held

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        """Tokens stored in the sequences, ``len(self) * (seq_len + 1)``."""
        return self._len * (self.seq_len + 1)

    def rows(self, indices) -> np.ndarray:
        """The sequences ``indices`` as an int64 array (len(indices), seq_len + 1)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self._corpus is None:
            return np.asarray(self._sequences[indices], dtype=np.int64)
        limit = self._len + (self.carry.count if self.carry is not None else 0)
        if indices.size and (indices.min() < 0 or indices.max() >= limit):
            raise IndexError(f"sequence indices outside [0, {limit})")
        if not indices.size:
            return np.zeros((0, self.seq_len + 1), dtype=np.int64)
        return np.stack([self._read(int(i)) for i in indices])

    def sequence_ranges(self, index: int) -> np.ndarray:
        """The ranges ``[a, b)`` of the token stream that sequence ``index`` holds (one, or a carried sequence's)."""
        if index >= self._len:
            return self.carry.sequence_ranges(index - self._len)
        width = self.seq_len + 1
        return np.array([[index * width, (index + 1) * width]], dtype=np.int64)

    def _read(self, index: int) -> np.ndarray:
        return np.concatenate(
            [self._corpus.read(self._start + a, self._start + b) for a, b in self.sequence_ranges(index)]
        )

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` int64 tensors of shape (len(indices), seq_len); labels are shifted by one."""
        return inputs_and_labels(self.rows(indices))


def inputs_and_labels(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``seq_len + 1`` tokens (packed sequences) -> ``(input_ids, labels)``: each label is the next token."""
    data = torch.from_numpy(rows)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshtron"


def cache_path(data_cfg: DataConfig, tokenizer) -> Path:
    """The prepared directory that caches this data tokenized by this tokenizer (any ``seq_len``)."""
    key = json.dumps(
        [
            CACHE_VERSION,
            source_fingerprint(data_cfg.path),
            data_cfg.text_field,
            tokenizer.name,
            tokenizer.vocab_size,
            data_cfg.max_documents,
        ]
    )
    root = Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()
    return root / hashlib.sha256(key.encode()).hexdigest()[:16]


def _build(data_cfg: DataConfig, tokenizer, path: Path) -> None:
    """Prepare the data into a folder of its own, then rename it to ``path`` (a builder that loses the race
    to another machine sharing the cache drops its copy)."""
    building = path.with_name(f"{path.name}.building-{uuid.uuid4().hex[:8]}")
    try:
        prepare_corpus(data_cfg, building, tokenizer=tokenizer)
        try:
            os.rename(building, path)
        except OSError:
            if not (path / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _empty_error(data_cfg: DataConfig, path: Path, setting: str) -> MeshtronError:
    try:
        meta = json.loads((path / MANIFEST).read_text())
        counts = f"{meta['tokens']:,} tokens from {meta['documents']:,} documents"
    except (OSError, ValueError, KeyError):
        counts = "too few tokens"
    return MeshtronError(
        f"{setting} '{data_cfg.path}' gave {counts} (EOS included), not one sequence of data.seq_len + 1 = "
        f"{data_cfg.seq_len + 1} tokens; add more data (or raise data.max_documents) or lower data.seq_len"
    )


def _failure_marker(path: Path) -> Path:
    """Where a failed build leaves its error (with the run it belongs to) for the processes waiting on it."""
    return path.with_suffix(".failed")


def _build_or_report(data_cfg: DataConfig, tokenizer, path: Path, run_id: str) -> None:
    marker = _failure_marker(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)  # an earlier run's
        _build(data_cfg, tokenizer, path)
    except Exception as err:
        report = {"run": run_id, "kind": type(err).__name__, "error": str(err)}
        with contextlib.suppress(OSError):  # the error itself matters more
            write_json_atomically(marker, report)
        raise


def _wait_for_build(path: Path, run_id: str) -> None:
    """Poll until the builder has renamed ``path`` into place; raise its error if it reports a failure."""
    marker, pause = _failure_marker(path), 0.01
    while not (path / MANIFEST).is_file():
        try:
            report = json.loads(marker.read_text())
        except (OSError, ValueError):
            report = None
        if report is not None and report.get("run") == run_id:
            kind = {"ConfigError": ConfigError, "MeshtronError": MeshtronError}.get(report.get("kind"))
            if kind is not None:
                raise kind(report["error"])
            raise MeshtronError(
                f"building the data cache '{path}' failed on local rank 0: {report.get('kind')}: "
                f"{report.get('error')}; see that process's error"
            )
        time.sleep(pause)
        pause = min(pause * 2, POLL_S)


def build_packed_dataset(
    data_cfg: DataConfig,
    tokenizer,
    *,
    is_builder: bool,
    run_id: str = "",
    barrier: Callable[[], None] = lambda: None,
    setting: str = "data.path",
) -> PackedDataset:
    """The packed sequences of ``data.seq_len + 1`` tokens of a prepared ``data.path``, or of the cache built from it.

    The cache is reused when present. The other processes wait for the builder without a collective
    (and without a time limit): they poll for its manifest, which appears when the builder renames the
    complete folder into place, or for the failure it reports under ``run_id`` (the same string on every
    process of a run). Several builders of the same cache (machines sharing ``data.cache_dir``) are safe:
    each renames a whole folder. ``barrier``, when given, is called once the data is there.
    """
    if is_prepared(data_cfg.path):
        path = Path(data_cfg.path).expanduser()
    else:
        path = cache_path(data_cfg, tokenizer)
        if is_builder and not (path / MANIFEST).is_file():
            _build_or_report(data_cfg, tokenizer, path, run_id)
        _wait_for_build(path, run_id)
    barrier()
    dataset = PackedDataset.from_corpus(TokenCorpus(path), data_cfg.seq_len, path)
    if len(dataset) == 0:
        raise _empty_error(data_cfg, path, setting)
    return dataset
