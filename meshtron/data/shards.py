"""Prepared token corpora on disk: sharded token files, a document index and a manifest.

A prepared directory holds, for each shard ``k``:

- ``shard-KKKKK.tokens``: the shard's documents' token ids, each document followed by EOS, as one raw
  little-endian array (``uint16`` when the vocabulary fits, else ``uint32``), read by ``np.memmap``;
- ``shard-KKKKK.docs.npy``: int64 end offsets of the shard's documents in that array (EOS included);
- ``shard-KKKKK.json``: its counts, written last: a shard without it is incomplete and is prepared again;

and ``manifest.json`` (written last of all: a directory without it is not a prepared corpus) with the source's
fingerprint, the tokenizer, the dtype, every shard's counts and the totals. Nothing depends on ``seq_len``:
training cuts sequences of ``seq_len + 1`` tokens from the token stream when it loads (``TokenCorpus``).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np

FORMAT = "meshtron-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a prepared corpus directory (its manifest names the format)."""
    try:
        return json.loads((Path(path).expanduser() / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_prepared_tokenizer(data_path: str, tokenizer) -> None:
    """Raise ConfigError when ``data_path`` is a prepared corpus tokenized by another tokenizer."""
    from meshtron.data.tokenizer import tokenizer_fingerprint
    from meshtron.errors import ConfigError

    if not is_prepared(data_path):
        return
    used = json.loads((Path(data_path).expanduser() / MANIFEST).read_text())["tokenizer"]
    if used.get("fingerprint") != tokenizer_fingerprint(tokenizer):
        raise ConfigError(
            f"data.path '{data_path}' was prepared with the tokenizer {used.get('name')!r} (vocabulary "
            f"{used.get('vocab_size')}), not data.tokenizer={tokenizer.name!r} (vocabulary {tokenizer.vocab_size}); "
            f"set data.tokenizer to the tokenizer it was prepared with"
        )


def write_json_atomically(path: Path, value: dict) -> None:
    """Write via a temporary file in the same folder and rename it into place (machines sharing the folder each
    write their own temporary file)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


class ShardWriter:
    """Writes one shard from documents given in chunks: ``add(token arrays)``, then ``close(counts)``."""

    def __init__(self, directory: Path, index: int, dtype: np.dtype, eos_token_id: int, first_document: int):
        self.directory, self.index, self.dtype = directory, index, dtype
        self.eos = np.array([eos_token_id], dtype=dtype)
        self.first_document = first_document
        self.name = shard_name(index)
        self._tokens_tmp = directory / f".{self.name}.tokens.tmp"
        self._file = open(self._tokens_tmp, "wb")  # noqa: SIM115 - closed in close()
        self.ends: list[int] = []
        self.tokens = 0
        self.characters = 0

    def add(self, documents: list[np.ndarray], characters: int) -> None:
        for ids in documents:
            self._file.write(np.asarray(ids).astype(self.dtype, copy=False).tobytes())
            self._file.write(self.eos.tobytes())
            self.tokens += int(ids.size) + 1
            self.ends.append(self.tokens)
        self.characters += characters

    def close(self) -> dict:
        """Finish the shard's files (the ``.json`` last) and return its counts."""
        self._file.close()
        os.replace(self._tokens_tmp, self.directory / f"{self.name}.tokens")
        with open(self.directory / f".{self.name}.docs.tmp", "wb") as fh:
            np.save(fh, np.asarray(self.ends, dtype=np.int64))
        os.replace(self.directory / f".{self.name}.docs.tmp", self.directory / f"{self.name}.docs.npy")
        counts = {
            "name": self.name,
            "first_document": self.first_document,
            "documents": len(self.ends),
            "tokens": self.tokens,
            "characters": self.characters,
            "dtype": self.dtype.name,
        }
        write_json_atomically(self.directory / f"{self.name}.json", counts)
        return counts


def complete_shard(directory: Path, index: int, first_document: int) -> dict | None:
    """The counts of shard ``index`` when it was written whole for documents from ``first_document``, else None."""
    name = shard_name(index)
    try:
        counts = json.loads((directory / f"{name}.json").read_text())
        size = (directory / f"{name}.tokens").stat().st_size
    except (OSError, ValueError):
        return None
    if counts.get("first_document") != first_document or not (directory / f"{name}.docs.npy").is_file():
        return None
    return counts if size == counts["tokens"] * np.dtype(counts["dtype"]).itemsize else None


class TokenCorpus:
    """A prepared directory's token stream (every shard in order), memory-mapped: ``read(start, stop)``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).expanduser()
        self.manifest = json.loads((self.directory / MANIFEST).read_text())
        self.dtype = np.dtype(self.manifest["dtype"])
        shards = [s for s in self.manifest["shards"] if s["tokens"] > 0]
        self._arrays = [
            np.memmap(self.directory / f"{s['name']}.tokens", dtype=self.dtype, mode="r", shape=(s["tokens"],))
            for s in shards
        ]
        self._starts = np.cumsum([0] + [s["tokens"] for s in shards])
        self.num_tokens = int(self._starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream as int64 (crossing shards as needed)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the corpus's {self.num_tokens}")
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts, pos = [], start
        while pos < stop:
            base = int(self._starts[first])
            take = min(stop, int(self._starts[first + 1])) - pos
            parts.append(self._arrays[first][pos - base : pos - base + take])
            pos += take
            first += 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def document_ends(self) -> np.ndarray:
        """End offsets of every document in the whole stream (the index of document boundaries)."""
        ends, offset = [], 0
        for shard in self.manifest["shards"]:
            ends.append(np.load(self.directory / f"{shard['name']}.docs.npy") + offset)
            offset += shard["tokens"]
        return np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
