"""The tiles of context-parallel attention and their masks, planned once per micro-batch.

The sequence is cut into ``2*cp`` chunks; a rank's queries (two chunks) meet every rank's keys chunk by
chunk. Each (query chunk, key chunk) tile of the attention matrix is skipped (the causal future, keys of earlier
documents only, or keys all outside the sliding window), full (every key visible), causal (the diagonal,
one document, no window inside it) or masked (by documents and / or the window).
The plan lists, per source rank, the tiles to compute with their mask: ``None`` (full), ``"causal"``,
a (B, Lq, Lk) boolean tensor (plain-PyTorch kernel) or a FlexAttention ``BlockMask`` (CUDA).

Sliding window (per layer, so one plan per window): a query at global index i sees a key at global index
j only if i - j < window. Chunks have known global offsets (chunk ``n`` starts at ``n * chunk``), so the
window is decided per tile from the distance between its chunks, and masks get the offset between
the query chunk's and the key chunk's starts.

Planning needs each chunk's first and last document id on the host. Training gives them, computed from the
batch while it is still in host memory (``SequenceLayout.document_bounds``): no device sync, neither per
micro-batch nor inside a pipeline stage's forward. Without them (evaluation, tests) the first plan of a
micro-batch reads them back from the device once (kept in ``SequenceLayout.document_ranges`` so that the plans
of other windows need none); every layer then reuses the plan from ``SequenceLayout.attention_cache``.
Document ids must not decrease along a row.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from meshtron.distributed.context_parallel.layout import chunk_document_bounds, chunk_ids
from meshtron.models.attention_kernels import BLOCK_SIZE, block_mask_of, effective_window

KERNELS = ("auto", "math", "flex")
"""``SequenceLayout.kernel``: ``auto`` (fused kernels: see ``tile_kernels.choose_tile_kernel``), ``math``
(plain PyTorch, float32) or ``flex`` (document-masked tiles by FlexAttention on any device, for tests)."""


def mask_kind(device, kernel: str) -> str:
    """How masked tiles are given: ``flex`` (a ``BlockMask``) on CUDA or when forced, else ``dense``."""
    if kernel not in KERNELS:
        raise ValueError(f"context-parallel kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    return "flex" if kernel == "flex" or (kernel == "auto" and torch.device(device).type == "cuda") else "dense"


def classify(
    first: list[list[int]] | None,
    last: list[list[int]] | None,
    q_chunk: int,
    kv_chunk: int,
    window: int | None = None,
    chunk: int | None = None,
) -> str:
    """``skip``, ``full``, ``causal`` or ``masked`` for one tile, from each row's first and last
    document id per chunk (``first[row][chunk]``); without documents (one per row) pass None. With a sliding
    ``window``, ``chunk`` is the chunk length: the tile is skipped when every (query, key) pair is at
    least ``window`` apart, and masked when some causal pair is."""
    if kv_chunk > q_chunk:
        return "skip"
    windowed = False
    if window is not None:
        gap = (q_chunk - kv_chunk) * chunk  # query index - key index runs from gap - (chunk - 1) to gap + chunk - 1
        if gap - (chunk - 1) >= window:
            return "skip"
        windowed = gap + chunk - 1 >= window
    if first is None:
        kind = "causal" if kv_chunk == q_chunk else "full"
        return "masked" if windowed else kind
    rows = range(len(first))
    if kv_chunk == q_chunk:
        kind = "causal" if all(first[r][q_chunk] == last[r][q_chunk] for r in rows) else "masked"
        return "masked" if windowed else kind
    if all(last[r][kv_chunk] < first[r][q_chunk] for r in rows):  # ids never decrease along a row
        return "skip"
    if not windowed and all(first[r][kv_chunk] == last[r][q_chunk] for r in rows):  # one document spans both
        return "full"
    return "masked"


def _document_ranges(layout, device):
    """(document ids on ``device``, first, last): each chunk's first and last id per row, from
    ``layout.document_bounds`` or else read back from the device once per micro-batch, kept in
    ``layout.document_ranges`` (None, None, None without documents)."""
    if layout.document_ids is None:
        return None, None, None
    ranges = layout.document_ranges
    key = str(device)
    if key not in ranges:
        docs = layout.document_ids.to(device)
        if layout.document_bounds is not None:
            first, last = layout.document_bounds
        else:
            first, last = chunk_document_bounds(docs, layout.cp)  # a device sync: given no bounds only
        ranges[key] = docs, first, last
    return ranges[key]


def plan_tiles(layout, device, window: int | None = None) -> dict[int, list[tuple[int, int, object]]]:
    """Per source rank: (query half, key half, mask) of every tile of the local queries x that rank's
    keys that the masks (causal, documents, the sliding ``window``) do not hide entirely."""
    device = torch.device(device)
    kind = mask_kind(device, layout.kernel)
    c = layout.seq_len // (2 * layout.cp)
    window = effective_window(window, layout.seq_len)
    docs, first, last = _document_ranges(layout, device)
    plan = {}
    for source in range(layout.cp):
        kept = []
        for qi, q_chunk in enumerate(chunk_ids(layout.cp, layout.rank)):
            for ki, kv_chunk in enumerate(chunk_ids(layout.cp, source)):
                what = classify(first, last, q_chunk, kv_chunk, window, c)
                if what == "skip":
                    continue
                if what == "masked":
                    build = chunk_block_mask if kind == "flex" else dense_chunk_mask
                    q_docs = kv_docs = None  # no documents: masked by the window only, batch 1
                    if docs is not None:
                        q_docs, kv_docs = (docs[:, i * c : (i + 1) * c] for i in (q_chunk, kv_chunk))
                    offset = (q_chunk - kv_chunk) * c
                    mask = build(
                        q_docs, kv_docs, q_chunk == kv_chunk, window=window, offset=offset, length=c, device=device
                    )
                else:
                    mask = "causal" if what == "causal" else None
                kept.append((qi, ki, mask))
        plan[source] = kept
    return plan


def plan_key(device, kernel: str, window: int | None = None) -> tuple:
    """The ``attention_cache`` key of a plan: ``("cp", device, mask kind)``, with the window appended when
    there is one."""
    key = ("cp", str(torch.device(device)), mask_kind(device, kernel))
    return key if window is None else (*key, window)


def planned_tiles(layout, device, window: int | None = None) -> dict[int, list[tuple[int, int, object]]]:
    """The micro-batch's plan for ``device`` and sliding ``window`` (None: none), made on first use and kept in
    ``layout.attention_cache``."""
    window = effective_window(window, layout.seq_len)
    key = plan_key(device, layout.kernel, window)
    if key not in layout.attention_cache:
        layout.attention_cache[key] = plan_tiles(layout, device, window)
    return layout.attention_cache[key]


def dense_chunk_mask(
    q_docs: torch.Tensor | None,
    kv_docs: torch.Tensor | None,
    diagonal: bool,
    window: int | None = None,
    offset: int = 0,
    length: int | None = None,
    device=None,
) -> torch.Tensor:
    """(B, Lq, Lk) bool: same document (and causal on the diagonal), and with a sliding ``window`` query index
    - key index < window, global indices: ``offset`` is the query chunk's start minus the key chunk's.
    Without documents (``q_docs`` and ``kv_docs`` None: chunks of ``length`` tokens on ``device``) batch 1."""
    if q_docs is None:
        visible = torch.ones(1, length, length, dtype=torch.bool, device=device)
    else:
        visible = q_docs[:, :, None] == kv_docs[:, None, :]
    if diagonal or window is not None:
        q_index = torch.arange(visible.shape[1], device=visible.device)[:, None] + offset
        distance = q_index - torch.arange(visible.shape[2], device=visible.device)[None, :]
        if diagonal:
            visible = visible & (distance >= 0)
        if window is not None:
            visible = visible & (distance < window)
    return visible


def chunk_block_mask(
    q_docs: torch.Tensor | None,
    kv_docs: torch.Tensor | None,
    diagonal: bool,
    block_size: int = BLOCK_SIZE,
    window: int | None = None,
    offset: int = 0,
    length: int | None = None,
    device=None,
) -> BlockMask:
    """FlexAttention ``BlockMask`` of ``dense_chunk_mask`` from per-block document ranges (no Lq x Lk tensor).
    Off the diagonal every key precedes every query: a block pair shares a document iff its last key's id
    reaches the first query's, and is full iff its first key's id equals the last query's. With a sliding
    ``window``, block pairs whose every (query, key) pair is at least ``window`` apart are skipped, and only
    those whose every pair is closer than ``window`` can be full. Without documents (``q_docs`` and ``kv_docs``
    None: chunks of ``length`` tokens on ``device``, masked by the window) the mask has batch 1."""
    documents = q_docs is not None
    if not documents:
        q_docs = kv_docs = torch.zeros(1, length, dtype=torch.int32, device=device)
    batch, length = q_docs.shape
    device = q_docs.device
    q_docs, kv_docs = q_docs.to(torch.int32), kv_docs.to(torch.int32)
    blocks = -(-length // block_size)
    starts = torch.arange(blocks, device=device) * block_size
    ends = torch.clamp(starts + block_size - 1, max=length - 1)
    q_first, q_last, kv_first, kv_last = q_docs[:, starts], q_docs[:, ends], kv_docs[:, starts], kv_docs[:, ends]
    complete = starts + block_size <= length
    visible = kv_last[:, None, :] >= q_first[:, :, None]
    full = (kv_first[:, None, :] == q_last[:, :, None]) & complete[:, None] & complete[None, :]
    if diagonal:
        index = torch.arange(blocks, device=device)
        visible = visible & (index[None, :] <= index[:, None])
        full = full & (index[None, :] < index[:, None])
    if window is not None:  # global query index - key index over a block pair: from the nearest to the farthest pair
        nearest = offset + starts[:, None] - ends[None, :]
        farthest = offset + ends[:, None] - starts[None, :]
        visible = visible & (nearest < window)
        full = full & (farthest < window)
    # Padding reads of the mask_mod see ids that match nothing: queries a new document, keys -1.
    pad = blocks * block_size - length
    q_padded = torch.cat([q_docs, (q_docs[:, -1:] + 1).expand(-1, pad)], dim=1)
    kv_padded = torch.cat([kv_docs, kv_docs.new_full((batch, pad), -1)], dim=1)
    if documents:
        mask_mod = _chunk_mask_mod(q_padded, kv_padded, diagonal, window, offset)
    else:
        mask_mod = _chunk_window_mask_mod(length, window, offset)
    return block_mask_of(visible, full, block_size, mask_mod, length)


def _chunk_window_mask_mod(length: int, window: int | None, offset: int):
    """Causal on global indices (``offset``: the query chunk's start minus the key chunk's) and inside the
    window, one document; padding keys (at ``length`` and beyond) hidden."""

    def causal_window(b, h, q_idx, kv_idx):
        distance = q_idx + offset - kv_idx
        visible = (distance >= 0) & (kv_idx < length)
        return visible if window is None else visible & (distance < window)

    return causal_window


def _chunk_mask_mod(
    q_docs: torch.Tensor, kv_docs: torch.Tensor, diagonal: bool, window: int | None = None, offset: int = 0
):
    if diagonal:

        def base(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_docs[b, q_idx] == kv_docs[b, kv_idx])
    else:

        def base(b, h, q_idx, kv_idx):
            return q_docs[b, q_idx] == kv_docs[b, kv_idx]

    if window is None:
        return base

    def windowed(b, h, q_idx, kv_idx):
        return base(b, h, q_idx, kv_idx) & (q_idx + offset - kv_idx < window)

    return windowed
