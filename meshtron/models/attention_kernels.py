"""Whole-sequence causal attention with document masks: the kernel, chosen per device.

* CUDA: FlexAttention (compiled once per process) with a document ``BlockMask``. The block mask is
  built from each 128-token block's first and last document id, so no sequence x sequence mask is
  ever made, and blocks the mask hides entirely are skipped by the kernel.
* elsewhere (CPU): PyTorch's SDPA, whose CPU flash kernel takes a dense (B, 1, S, S) boolean mask
  (FlexAttention has no CPU backward).

Masks are built once per micro-batch: callers pass a ``cache`` dict that lives as long as the
micro-batch (``SequenceLayout.attention_cache``), so every layer reuses the first layer's mask.
Document ids must not decrease along a row (``attention.document_ids`` counts EOS tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

KERNELS = ("auto", "flex", "sdpa")
BLOCK_SIZE = 128
"""FlexAttention's (query, key) block size: the granularity at which masked work is skipped."""


def choose_kernel(device: torch.device | str) -> str:
    """The kernel ``auto`` means on ``device``: ``flex`` on CUDA, ``sdpa`` elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def document_attention(query, key, value, document_ids, scale: float, kernel: str = "auto", cache: dict | None = None):
    """Causal attention within documents: ``query`` (B, H, L, D), ``key``/``value`` (B, Hkv, L, D) with H a
    multiple of Hkv, ``document_ids`` (B, L) or None (one document per row) -> (B, H, L, D)."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = choose_kernel(query.device)
    if kernel == "flex":
        return _flex_attention(query, key, value, document_ids, scale, cache)
    if document_ids is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
    cache_key = ("dense", str(query.device), query.shape[2])
    visible = _cached(cache, cache_key, dense_document_mask, document_ids, query.device)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale, enable_gqa=True)


def prepare_masks(cache: dict, document_ids: torch.Tensor | None, device: torch.device, length: int) -> None:
    """Build the mask ``document_attention`` will look up, before the model runs: compiled decoder
    blocks then find it in ``cache`` and never call a mask builder (no graph break)."""
    if choose_kernel(device) == "flex":
        _cached(cache, ("flex", str(device), length), document_block_mask, document_ids, device, length)
    elif document_ids is not None:
        _cached(cache, ("dense", str(device), length), dense_document_mask, document_ids, device)


@functools.cache
def _compiled_flex():
    # dynamic=False: shapes are fixed in training, and a dynamic-shape flex kernel is slower.
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(query, key, value, document_ids, scale: float, cache: dict | None):
    length = query.shape[2]
    cache_key = ("flex", str(query.device), length)
    block_mask = _cached(cache, cache_key, document_block_mask, document_ids, query.device, length)
    # Eager flex_attention runs an unfused reference (CPU tests); inside a compiled block dynamo fuses it.
    on_gpu = query.device.type == "cuda" and not torch.compiler.is_compiling()
    attend = _compiled_flex() if on_gpu else flex_attention
    return attend(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


def _cached(cache: dict | None, cache_key: tuple, build, *args):
    """``build(*args)``, made once per ``cache`` (under torch.compile the build runs eagerly, once)."""
    if cache is None:
        return build(*args)
    if cache_key not in cache:
        cache[cache_key] = build(*args)
    return cache[cache_key]


@torch.compiler.disable
def dense_document_mask(document_ids: torch.Tensor, device) -> torch.Tensor:
    """(B, 1, L, L) bool, True where a query may attend a key: causal and same document."""
    docs = document_ids.to(device)
    causal = torch.ones(docs.shape[1], docs.shape[1], dtype=torch.bool, device=device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def document_mask_mod(document_ids: torch.Tensor | None):
    """FlexAttention ``mask_mod``: causal, and same document when ``document_ids`` (B, >= L) is given."""
    if document_ids is None:
        return _causal
    docs = document_ids

    def causal_same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return causal_same_document


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@torch.compiler.disable
def document_block_mask(
    document_ids: torch.Tensor | None, device, length: int, block_size: int = BLOCK_SIZE
) -> BlockMask:
    """The ``BlockMask`` of ``document_mask_mod`` for sequences of ``length`` tokens, from per-block
    document ranges (O(B x (L / block_size)^2) work, no L x L tensor); batch 1 when ``document_ids`` is None."""
    blocks = -(-length // block_size)
    padded = blocks * block_size
    if document_ids is None:
        docs = None
        first = last = torch.zeros(1, blocks, dtype=torch.int32, device=device)
    else:
        docs = document_ids.to(device=device, dtype=torch.int32)
        # Pad with a new document so ids stay non-decreasing and the mask_mod never reads past the row.
        docs = torch.cat([docs, (docs[:, -1:] + 1).expand(-1, padded - length)], dim=1)
        first, last = docs[:, ::block_size], docs[:, block_size - 1 :: block_size]
    index = torch.arange(blocks, device=device)
    q_block, kv_block = index[:, None], index[None, :]
    complete = (index + 1) * block_size <= length
    # Every key of an off-diagonal block precedes every query, and ids do not decrease: the block
    # shares a document iff its last key's id equals the first query's, is full iff all ids are equal.
    visible = (kv_block <= q_block) & (last[:, None, :] >= first[:, :, None])
    full = (kv_block < q_block) & (first[:, None, :] == last[:, :, None]) & complete[:, None] & complete[None, :]
    kv_num, kv_index = _ordered(visible & ~full)
    full_num, full_index = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_index, full_num, full_index,
        BLOCK_SIZE=block_size, mask_mod=document_mask_mod(docs), seq_lengths=(length, length),
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q, KV) block booleans -> (count (B, 1, Q), indices (B, 1, Q, KV)) with the True blocks first."""
    dense = dense[:, None].to(torch.int32)
    count = dense.sum(-1).to(torch.int32)
    index = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, index
