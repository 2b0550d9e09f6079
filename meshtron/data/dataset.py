"""The packed, cached training dataset."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from meshtron.config import DataConfig
from meshtron.data.packing import pack_documents
from meshtron.data.sources import iter_documents, source_fingerprint
from meshtron.errors import MeshtronError

FORMAT_VERSION = 1
ENCODE_CHUNK = 256


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


def build_packed_dataset(
    data_cfg: DataConfig, tokenizer, *, is_builder: bool, barrier: Callable[[], None] = lambda: None
) -> PackedDataset:
    """Build the cached blocks on the builder (one process per machine), then load them everywhere.

    Every process must call this (it calls ``barrier()`` once). The cache file is reused when present.
    """
    path = cache_path(data_cfg, tokenizer)
    if is_builder and not path.is_file():
        _build(data_cfg, tokenizer, path)
    barrier()
    if not path.is_file():
        raise MeshtronError(
            f"data cache '{path}' is missing after the build; each machine needs one builder process, "
            "or set data.cache_dir to a folder every process can see",
            uniform=False,
        )
    blocks = np.load(path, mmap_mode="r")
    if len(blocks) == 0:
        raise _empty_error(data_cfg, path)
    return PackedDataset(blocks, path)
