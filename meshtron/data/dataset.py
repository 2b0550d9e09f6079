"""The packed, cached training dataset.

One process per machine (local rank 0) builds the cache file; the others wait for it by watching the
file system, not in a collective, so a long first build never meets the collective timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from meshtron.config import DataConfig
from meshtron.data.packing import pack_documents
from meshtron.data.sources import iter_documents, source_fingerprint
from meshtron.errors import ConfigError, MeshtronError

FORMAT_VERSION = 1
ENCODE_CHUNK = 256
POLL_S = 1.0
"""Longest pause between two looks of a waiting process for the cache file (or the builder's failure)."""


class PackedDataset:
    """Blocks of ``seq_len + 1`` tokens (an array or ``np.memmap`` of shape (num_blocks, seq_len + 1))."""

    def __init__(self, blocks: np.ndarray, path: Path | None = None):
        if blocks.ndim != 2 or blocks.shape[1] < 2:
            raise ValueError(f"blocks must have shape (num_blocks, seq_len + 1), got {blocks.shape}")
        self.blocks = blocks
        self.path = path
        self.seq_len = blocks.shape[1] - 1

    def __len__(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_tokens(self) -> int:
        """Tokens stored in the blocks, ``len(self) * (seq_len + 1)``."""
        return int(self.blocks.size)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)`` int64 tensors of shape (len(indices), seq_len); labels are shifted by one."""
        rows = np.asarray(self.blocks[np.asarray(indices, dtype=np.int64)], dtype=np.int64)
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshtron"


def cache_path(data_cfg: DataConfig, tokenizer) -> Path:
    """Where the packed blocks for this data, tokenizer and ``seq_len`` are cached."""
    key = json.dumps(
        [
            FORMAT_VERSION,
            source_fingerprint(data_cfg.path),
            data_cfg.text_field,
            tokenizer.name,
            tokenizer.vocab_size,
            data_cfg.seq_len,
            data_cfg.max_documents,
        ]
    )
    root = Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()
    return root / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".npy")


def _tokenized(data_cfg: DataConfig, tokenizer, stats: dict[str, int]) -> Iterator[np.ndarray]:
    """Token arrays of the documents, encoded ``ENCODE_CHUNK`` at a time; counts go to ``stats``."""
    chunk: list[str] = []
    for doc in iter_documents(data_cfg.path, data_cfg.text_field, data_cfg.max_documents):
        chunk.append(doc)
        if len(chunk) == ENCODE_CHUNK:
            yield from _encode(chunk, tokenizer, stats)
            chunk = []
    yield from _encode(chunk, tokenizer, stats)


def _encode(texts: list[str], tokenizer, stats: dict[str, int]) -> list[np.ndarray]:
    ids = tokenizer.encode_batch(texts) if texts else []
    stats["documents"] += len(ids)
    stats["tokens"] += sum(int(x.size) + 1 for x in ids)
    return ids


def _atomic_write(target: Path, write: Callable) -> None:
    """Write via a temp file in the same folder, then ``os.replace`` it into place."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _build(data_cfg: DataConfig, tokenizer, path: Path) -> None:
    """Tokenize and pack; write the counts (``.json``) and then the blocks (``.npy``) to the cache."""
    stats = {"documents": 0, "tokens": 0}
    blocks = pack_documents(_tokenized(data_cfg, tokenizer, stats), tokenizer.eos_token_id, data_cfg.seq_len)
    meta = {"path": data_cfg.path, "tokenizer": tokenizer.name, "seq_len": data_cfg.seq_len, "blocks": len(blocks)}
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path.with_suffix(".json"), lambda fh: fh.write(json.dumps({**meta, **stats}).encode()))
    _atomic_write(path, lambda fh: np.save(fh, blocks))


def _empty_error(data_cfg: DataConfig, path: Path) -> MeshtronError:
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        counts = f"{meta['tokens']:,} tokens from {meta['documents']:,} documents"
    except (OSError, ValueError, KeyError):
        counts = "too few tokens"
    return MeshtronError(
        f"data.path '{data_cfg.path}' gave {counts} (EOS included), not one block of data.seq_len + 1 = "
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
            _atomic_write(marker, lambda fh: fh.write(json.dumps(report).encode()))
        raise


def _wait_for_build(path: Path, run_id: str) -> None:
    """Poll until the builder has renamed ``path`` into place; raise its error if it reports a failure."""
    marker, pause = _failure_marker(path), 0.01
    while not path.is_file():
        try:
            report = json.loads(marker.read_text())
        except (OSError, ValueError):
            report = None
        if report is not None and report.get("run") == run_id:
            kind = {"ConfigError": ConfigError, "MeshtronError": MeshtronError}.get(report.get("kind"))
            if kind is not None:
                raise kind(report["error"])
            raise MeshtronError(f"building the data cache '{path}' failed on local rank 0: {report.get('kind')}: "
                                f"{report.get('error')}; see that process's error")
        time.sleep(pause)
        pause = min(pause * 2, POLL_S)


def build_packed_dataset(
    data_cfg: DataConfig, tokenizer, *, is_builder: bool, run_id: str = "", barrier: Callable[[], None] = lambda: None
) -> PackedDataset:
    """Build the cached blocks on the builder (one process per machine), then load them everywhere.

    The cache file is reused when present. The other processes wait for the builder without a collective
    (and without a time limit): they poll for the file, which the builder renames into place when complete,
    or for the failure it reports under ``run_id`` (the same string on every process of a run). Several
    builders of the same file (machines sharing ``data.cache_dir``) are safe: each renames a whole file.
    ``barrier``, when given, is called once the file is there (a sync point for callers that want one).
    """
    path = cache_path(data_cfg, tokenizer)
    if is_builder and not path.is_file():
        _build_or_report(data_cfg, tokenizer, path, run_id)
    _wait_for_build(path, run_id)
    barrier()
    blocks = np.load(path, mmap_mode="r")
    if len(blocks) == 0:
        raise _empty_error(data_cfg, path)
    return PackedDataset(blocks, path)
