"""Whole-sequence causal attention with document masks and an optional sliding window: the kernel, chosen per device.

* CUDA: FlexAttention (compiled once per process) with a document ``BlockMask``. The block mask is
  built from each 128-token block's first and last document id, so no sequence x sequence mask is
  ever made, and blocks the mask hides entirely are skipped by the kernel.
* elsewhere (CPU): PyTorch's SDPA, whose CPU flash kernel takes a dense (B, 1, S, S) boolean mask
  (FlexAttention has no CPU backward).

Sliding window (``window``, per layer: transformers' attention modules pass ``sliding_window``): a query
at index i also needs i - j < window to see the key at index j (transformers' ``sliding_window_overlay``),
besides causal (j <= i) and same document. A window of at least the sequence length changes nothing and
is treated as none. On CUDA the block mask skips the 128-token blocks that lie entirely outside the window.

Soft-capped scores (Gemma 2) and attention sinks (gpt-oss: a learned logit per head in the softmax's denominator
that attends to no value) are computed as transformers' eager attention does on CPU (``eager_attention``); on CUDA
the cap is a FlexAttention ``score_mod`` and the sink a correction of FlexAttention's output by its log-sum-exp
(``sink_correction``; both checked on an H200 against the eager math by ``bench/attention_kernels.py``).

Masks are built once per micro-batch: callers pass a ``cache`` dict that lives as long as the
micro-batch (``SequenceLayout.attention_cache``), so every layer reuses the first layer's mask (one per
window: full and sliding layers alternate in Gemma and Qwen2). Document ids must not decrease along a row
(``attention.document_ids`` counts EOS tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

KERNELS = ("auto", "flex", "sdpa")
BLOCK_SIZE = 128
"""FlexAttention's (query, key) block size: the granularity at which masked work is skipped."""


def choose_kernel(device: torch.device | str) -> str:
    """The kernel ``auto`` means on ``device``: ``flex`` on CUDA, ``sdpa`` elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def effective_window(window: int | None, length: int) -> int | None:
    """The sliding window that restricts a sequence of ``length`` tokens: None when there is none or it is at
    least ``length`` long (then every causal key is inside it)."""
    if window is None:
        return None
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    return None if window >= length else window


def mask_key(kind: str, device, length: int, window: int | None = None) -> tuple:
    """The ``cache`` key of a mask: ``(kind, device, length)``, with the window appended when there is one."""
    key = (kind, str(device), length)
    return key if window is None else (*key, window)


def document_attention(
    query,
    key,
    value,
    document_ids,
    scale: float,
    kernel: str = "auto",
    cache: dict | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Causal attention within documents: ``query`` (B, H, L, D), ``key``/``value`` (B, Hkv, L, D) with H a
    multiple of Hkv, ``document_ids`` (B, L) or None (one document per row), ``window`` the sliding window or
    None, ``softcap`` the scores' soft cap (Gemma 2: ``softcap * tanh(score / softcap)``) or None, ``sinks`` (H,)
    the heads' sink logits (gpt-oss) or None -> (B, H, L, D)."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = choose_kernel(query.device)
    length = query.shape[2]
    window = effective_window(window, length)
    if kernel == "flex":
        return _flex_attention(query, key, value, document_ids, scale, cache, window, softcap, sinks)
    if document_ids is None and window is None and not softcap and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
    cache_key = mask_key("dense", query.device, length, window)
    visible = _cached(cache, cache_key, dense_document_mask, document_ids, query.device, window, length)
    if softcap or sinks is not None:  # SDPA can neither cap scores nor add sinks: transformers' eager math
        return eager_attention(query, key, value, visible, scale, softcap, sinks)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale, enable_gqa=True)


def prepare_masks(
    cache: dict, document_ids: torch.Tensor | None, device: torch.device, length: int, windows=(None,)
) -> None:
    """Build the masks ``document_attention`` will look up, one per sliding window in ``windows`` (None: no
    window), before the model runs: compiled decoder blocks then find them in ``cache`` and never call a
    mask builder (no graph break)."""
    for window in dict.fromkeys(effective_window(w, length) for w in windows):
        if choose_kernel(device) == "flex":
            _cached(
                cache,
                mask_key("flex", device, length, window),
                document_block_mask,
                document_ids,
                device,
                length,
                BLOCK_SIZE,
                window,
            )
        elif document_ids is not None or window is not None:
            _cached(
                cache,
                mask_key("dense", device, length, window),
                dense_document_mask,
                document_ids,
                device,
                window,
                length,
            )


@functools.cache
def _compiled_flex():
    # dynamic=False: shapes are fixed in training, and a dynamic-shape flex kernel is slower.
    return torch.compile(flex_attention, dynamic=False)


def eager_attention(
    query, key, value, visible: torch.Tensor, scale: float, softcap: float | None = None, sinks=None
) -> torch.Tensor:
    """Attention as transformers' ``eager_attention_forward`` computes it: scores ``q k^T * scale``, soft-capped to
    ``softcap * tanh(scores / softcap)`` (Gemma 2) when ``softcap`` is set, masked (``visible`` (B or 1, 1, L, L)
    bool), softmax in float32 or wider (with ``sinks`` (H,): over the scores and the head's sink logit, which is then
    dropped, as gpt-oss does), back to the query's dtype, times v. Keeps the (B, H, L, L) scores for backward."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    accumulate = torch.promote_types(scores.dtype, torch.float32)  # float32 at least (float64 stays)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=accumulate)
    else:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=accumulate)[..., :-1]
    return torch.matmul(weights.to(query.dtype), value)


def sink_correction(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` (B, H, L, D) of a softmax whose denominator was ``exp(lse)`` (``lse`` (B, H, L), natural
    log, as FlexAttention's ``return_lse`` gives it), rescaled to a softmax that also counts each head's sink logit
    ``sinks`` (H,) without a value: ``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)``."""
    accumulate = torch.promote_types(lse.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(accumulate) - sinks.to(accumulate).reshape(1, -1, 1))
    return (out * keep.unsqueeze(-1).to(out.dtype)).to(out.dtype)


def _softcap_score_mod(softcap: float):
    """FlexAttention ``score_mod`` (after the scale) for soft-capped scores."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def _flex_attention(
    query,
    key,
    value,
    document_ids,
    scale: float,
    cache: dict | None,
    window: int | None = None,
    softcap=None,
    sinks=None,
):
    length = query.shape[2]
    window = effective_window(window, length)
    cache_key = mask_key("flex", query.device, length, window)
    block_mask = _cached(cache, cache_key, document_block_mask, document_ids, query.device, length, BLOCK_SIZE, window)
    # Eager flex_attention runs an unfused reference (CPU tests); inside a compiled block dynamo fuses it.
    on_gpu = query.device.type == "cuda" and not torch.compiler.is_compiling()
    attend = _compiled_flex() if on_gpu else flex_attention
    score_mod = _softcap_score_mod(softcap) if softcap else None
    if sinks is None:
        return attend(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)
    # The sinks through the log-sum-exp (on CPU the tests run FlexAttention's eager reference, forward only).
    out, aux = attend(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
    )
    return sink_correction(out, aux.lse, sinks)


def _cached(cache: dict | None, cache_key: tuple, build, *args):
    """``build(*args)``, made once per ``cache`` (under torch.compile the build runs eagerly, once)."""
    if cache is None:
        return build(*args)
    if cache_key not in cache:
        cache[cache_key] = build(*args)
    return cache[cache_key]


@torch.compiler.disable
def dense_document_mask(
    document_ids: torch.Tensor | None, device, window: int | None = None, length: int | None = None
) -> torch.Tensor:
    """(B, 1, L, L) bool, True where a query may attend a key: causal, same document (``document_ids`` (B, L);
    None: one document, batch 1, ``length`` tokens) and inside the sliding ``window`` (query index - key index
    < window) when there is one."""
    docs = None if document_ids is None else document_ids.to(device)
    length = docs.shape[1] if docs is not None else length
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    if docs is None:
        return visible[None, None]
    return (visible & (docs[:, :, None] == docs[:, None, :]))[:, None]


def document_mask_mod(document_ids: torch.Tensor | None, window: int | None = None):
    """FlexAttention ``mask_mod``: causal, same document when ``document_ids`` (B, >= L) is given, and inside
    the sliding ``window`` (q_idx - kv_idx < window) when there is one."""
    if document_ids is None:
        base = _causal
    else:
        docs = document_ids

        def base(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    if window is None:
        return base

    def windowed(b, h, q_idx, kv_idx):
        return base(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    return windowed


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@torch.compiler.disable
def document_block_mask(
    document_ids: torch.Tensor | None, device, length: int, block_size: int = BLOCK_SIZE, window: int | None = None
) -> BlockMask:
    """The ``BlockMask`` of ``document_mask_mod`` for sequences of ``length`` tokens, from per-block
    document ranges (O(B x (L / block_size)^2) work, no L x L tensor); batch 1 when ``document_ids`` is None.
    With a sliding ``window``, blocks whose every (query, key) pair is at least ``window`` apart are skipped and
    only blocks whose every pair is closer than ``window`` can be full."""
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
    if window is not None:
        # Query index - key index over a block pair runs from (q - kv) * size - (size - 1)
        # to (q - kv) * size + size - 1.
        gap = (q_block - kv_block) * block_size
        visible = visible & (gap - (block_size - 1) < window)
        full = full & (gap + block_size - 1 < window)
    kv_num, kv_index = _ordered(visible & ~full)
    full_num, full_index = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=block_size,
        mask_mod=document_mask_mod(docs, window),
        seq_lengths=(length, length),
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q, KV) block booleans -> (count (B, 1, Q), indices (B, 1, Q, KV)) with the True blocks first."""
    dense = dense[:, None].to(torch.int32)
    count = dense.sum(-1).to(torch.int32)
    index = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, index
