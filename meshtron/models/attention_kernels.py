"""Whole-sequence causal attention with document masks and an optional sliding window: the kernel, chosen per device.

* CUDA: FlexAttention (compiled once per process) with a document ``BlockMask``. The block mask is
  built from each 128-token block's first and last document id, so no sequence x sequence mask is
  ever made, and blocks the mask hides entirely are skipped by the kernel.
* elsewhere (CPU): PyTorch's SDPA, whose CPU flash kernel takes a dense (B, 1, S, S) boolean mask
  (FlexAttention has no CPU backward).
* ``varlen`` (CUDA, chosen by ``model.attention_kernel=varlen``, never by ``auto``; **not yet run on a GPU**):
  torch's flash attention over variable-length sequences (``torch.nn.attention.varlen.varlen_attn``): the rows
  are laid end to end as (B*L, H, D) and every document is one causal sequence of it, given by the documents'
  cumulative lengths (``document_lengths``), so the kernel does the work of causal attention over the
  documents and nothing else. For plain causal document masks in fp16 / bf16 only: layers with a sliding
  window, soft cap or sinks (and fp32) keep FlexAttention. Check it on a GPU with
  ``python bench/attention_kernels.py`` (docs/attention.md).

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

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError, MeshtronError
from meshtron.tensors import compile_disabled

KERNELS = ("auto", "flex", "varlen", "sdpa")
BLOCK_SIZE = 128
"""FlexAttention's (query, key) block size: the granularity at which masked work is skipped."""


def choose_kernel(device: torch.device | str) -> str:
    """The kernel ``auto`` means on ``device``: ``flex`` on CUDA, ``sdpa`` elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def resolve_kernel(setting: str, device_type: str) -> str:
    """``model.attention_kernel`` for a run on ``device_type``: ``auto`` resolved (``choose_kernel``), once, by
    preflight."""
    return choose_kernel(device_type) if setting == "auto" else setting


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


VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""What flash attention computes in (fp32 calls of the varlen kernel go to FlexAttention)."""


def varlen_applies(query: torch.Tensor, value: torch.Tensor, window=None, softcap=None, sinks=None) -> bool:
    """Whether the varlen kernel computes this call: a plain causal document mask (no sliding window, soft cap
    or sinks), in fp16 / bf16, with q/k and v heads of one size, a multiple of 8 up to 256 (flash attention's)."""
    dim = query.shape[-1]
    plain = window is None and not softcap and sinks is None
    return plain and query.dtype in VARLEN_DTYPES and value.shape[-1] == dim and dim % 8 == 0 and dim <= 256


def check_attention_kernel(model: ModelConfig, cp: int, mask_documents: bool, device_type: str, precision: str) -> None:
    """Refuse a ``model.attention_kernel`` that cannot run: not ``auto`` where meshtron's whole-sequence attention
    is not in use (cp > 1, or no document masks), ``varlen`` off CUDA, without torch's varlen attention, or with
    fp32 compute. ``cp``: ``parallel.cp``; ``mask_documents``: ``data.mask_documents``; ``precision``: the run's
    mixed precision (``bf16``, ``fp16`` or ``none``)."""
    setting = model.attention_kernel
    if setting == "auto":
        return
    if cp > 1:
        raise ConfigError(
            f"model.attention_kernel={setting} applies with parallel.cp=1 only (context parallelism has its own "
            "kernels); set model.attention_kernel=auto"
        )
    if not mask_documents:
        raise ConfigError(
            f"model.attention_kernel={setting} applies to document-masked attention only (without "
            "data.mask_documents the model's own model.attn_implementation runs); set model.attention_kernel=auto"
        )
    if setting != "varlen":
        return
    if device_type != "cuda":
        raise ConfigError(
            f"model.attention_kernel=varlen runs on CUDA only (flash attention), not on {device_type}; "
            "set model.attention_kernel=auto"
        )
    from meshtron.models import varlen  # torch's varlen module imports dynamo: only varlen runs import it

    if varlen.VARLEN is None:
        raise ConfigError(
            f"model.attention_kernel=varlen needs torch.nn.attention.varlen (torch >= 2.10), which torch "
            f"{torch.__version__} lacks; set model.attention_kernel=auto"
        )
    if precision == "none" and model.dtype not in ("bfloat16", "float16"):
        raise ConfigError(
            f"model.attention_kernel=varlen computes in bf16 / fp16 only (flash attention), and this run computes "
            f"in {model.dtype}; set precision.mixed_precision=bf16 or model.attention_kernel=auto"
        )


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
    if kernel == "varlen":
        if varlen_applies(query, value, window, softcap, sinks):
            return _varlen_attention(query, key, value, document_ids, scale, cache)
        kernel = "flex"  # sliding windows, soft caps, sinks, fp32: FlexAttention
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
    cache: dict,
    document_ids: torch.Tensor | None,
    device: torch.device,
    length: int,
    windows=(None,),
    kernel: str = "auto",
    lengths: torch.Tensor | None = None,
) -> None:
    """Build the masks ``document_attention`` will look up, one per sliding window in ``windows`` (None: no
    window), before the model runs: compiled decoder blocks then find them in ``cache`` and never call a
    mask builder (no graph break). ``kernel``: ``document_attention``'s. With ``varlen``: the documents'
    cumulative lengths too, copied from ``lengths`` (``document_lengths`` of these rows, computed on the host: no
    device sync) or else computed from ``document_ids`` (one device sync); the FlexAttention masks are built as
    well, for the layers the varlen kernel leaves to FlexAttention (windows, soft caps, sinks)."""
    kernel = choose_kernel(device) if kernel == "auto" else kernel
    if kernel == "varlen":
        if lengths is not None:
            _cached(cache, mask_key("varlen", device, length), _to_device, lengths, device)
        elif document_ids is not None:  # without documents the first call knows the batch size
            _cached(cache, mask_key("varlen", device, length), document_lengths, document_ids, device)
        kernel = "flex"
    for window in dict.fromkeys(effective_window(w, length) for w in windows):
        if kernel == "flex":
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


@compile_disabled
def document_lengths(
    document_ids: torch.Tensor | None, device=None, rows: int = 1, length: int | None = None
) -> torch.Tensor:
    """(N + 1,) int32 on ``device`` (default: ``document_ids``'): the cumulative lengths of the N documents of
    ``document_ids`` (B, L) laid end to end row by row (B*L tokens), what the varlen kernel takes: 0, the index
    at which every later document starts, B*L. A document starts wherever the id changes and at every row's
    start (the rows are separate sequences: a document never runs on into the next row). None: one document per
    row, ``rows`` rows of ``length`` tokens. From a host tensor nothing is read back from a device; from a device
    tensor the count of documents is (one sync), so training computes them on the host (meshtron.train.batch)."""
    if document_ids is None:
        return torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)
    rows, length = document_ids.shape
    starts = torch.ones(rows, length, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    end = torch.full((1,), rows * length, dtype=torch.int64, device=document_ids.device)
    lengths = torch.cat([starts.flatten().nonzero().flatten(), end]).to(torch.int32)
    return lengths if device is None else _to_device(lengths, device)


def _to_device(lengths: torch.Tensor, device) -> torch.Tensor:
    """``lengths`` on ``device`` (an asynchronous copy from the host), marked as of varying size for
    torch.compile: a micro-batch with another count of documents does not recompile the blocks."""
    lengths = lengths.to(device, non_blocking=True)
    torch._dynamo.maybe_mark_dynamic(lengths, 0)
    return lengths


def pack_rows(tensor: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B*L, H, D): the rows laid end to end, token b*L + i of row b at index i (a copy unless
    the tensor's memory is already (B, L, H, D), as the projections make it)."""
    return tensor.transpose(1, 2).reshape(-1, tensor.shape[1], tensor.shape[3])


def unpack_rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """(B*L, H, D) -> (B, H, L, D), a view (its (B, L, H, D) memory is what the caller's transpose back wants)."""
    return tensor.unflatten(0, (batch, -1)).transpose(1, 2)


def _varlen_attention(query, key, value, document_ids, scale: float, cache: dict | None) -> torch.Tensor:
    """Causal attention within documents by the varlen kernel: each document of each row is one sequence of the
    packed rows. The longest sequence is bounded by the row length L (no device read; blocks past a document's
    end do nothing)."""
    from meshtron.models.varlen import VARLEN  # imported already by check_attention_kernel (no graph break)

    if VARLEN is None:
        raise MeshtronError(
            f"attention kernel 'varlen' needs torch.nn.attention.varlen (torch >= 2.10); torch {torch.__version__} "
            "has none"
        )
    batch, length = query.shape[0], query.shape[2]
    key_ = mask_key("varlen", query.device, length)
    lengths = _cached(cache, key_, document_lengths, document_ids, query.device, batch, length)
    out = VARLEN(pack_rows(query), pack_rows(key), pack_rows(value), lengths, length, scale)
    return unpack_rows(out, batch)


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


@compile_disabled
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


@compile_disabled
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
    return block_mask_of(visible, full, block_size, document_mask_mod(docs, window), length)


def block_mask_of(visible: torch.Tensor, full: torch.Tensor, block_size: int, mask_mod, length: int) -> BlockMask:
    """The ``BlockMask`` of (B, Q, KV) block booleans over ``length`` queries and keys: ``visible`` blocks are
    computed, ``full`` ones (a subset) without calling ``mask_mod``, which masks the others score by score."""
    kv_num, kv_index = _ordered(visible & ~full)
    full_num, full_index = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q, KV) block booleans -> (count (B, 1, Q), indices (B, 1, Q, KV)) with the True blocks first."""
    dense = dense[:, None].to(torch.int32)
    count = dense.sum(-1).to(torch.int32)
    index = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, index
