"""Pack tokenized documents into fixed-length training blocks."""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

CHUNK_TOKENS = 1 << 22
"""Tokens buffered before cutting blocks; bounds the temporary memory of packing."""


def iter_blocks(
    docs: Iterable[np.ndarray], eos_token_id: int, seq_len: int, chunk_tokens: int = CHUNK_TOKENS
) -> Iterator[np.ndarray]:
    """Yield int32 arrays of shape (n, seq_len + 1): the documents, each followed by EOS, cut in blocks."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    block = seq_len + 1
    eos = np.array([eos_token_id], dtype=np.int32)
    pending: list[np.ndarray] = []
    size = 0
    for doc in docs:
        pending.append(np.asarray(doc, dtype=np.int32).reshape(-1))
        pending.append(eos)
        size += pending[-2].size + 1
        if size >= max(chunk_tokens, block):
            flat = np.concatenate(pending)
            full = flat.size // block * block
            yield flat[:full].reshape(-1, block)
            pending, size = [flat[full:]], flat.size - full
    if size >= block:
        flat = np.concatenate(pending)
        yield flat[: flat.size // block * block].reshape(-1, block)


def pack_documents(docs: Iterable[np.ndarray], eos_token_id: int, seq_len: int) -> np.ndarray:
    """Concatenate ``docs`` with EOS after each and cut into (num_blocks, seq_len + 1); the remainder is dropped."""
    chunks = list(iter_blocks(docs, eos_token_id, seq_len))
    if not chunks:
        return np.zeros((0, seq_len + 1), dtype=np.int32)
    return np.ascontiguousarray(np.concatenate(chunks), dtype=np.int32)
