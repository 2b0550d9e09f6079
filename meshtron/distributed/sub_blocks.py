"""The sub-blocks of context-parallel attention and their masks, planned once per micro-batch.

The sequence is cut into ``2*cp`` chunks; a rank's queries (two chunks) meet every rank's keys chunk by
chunk. Each (query chunk, key chunk) sub-block is skipped (the causal future, or keys of earlier
documents only), full (every key visible), causal (the diagonal, one document) or masked by documents.
The plan lists, per source rank, the sub-blocks to compute with their mask: ``None`` (full), ``"causal"``,
a (B, Lq, Lk) boolean tensor (plain-PyTorch kernel) or a FlexAttention ``BlockMask`` (CUDA).

Planning reads each chunk's first and last document id on the host once (one device sync per
micro-batch, in ``sequence_inputs``, outside the layers); every layer then reuses the plan from
``SequenceLayout.attention_cache``. Document ids must not decrease along a row.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from meshtron.models.attention_kernels import BLOCK_SIZE, _ordered

KERNELS = ("auto", "math", "flex")
"""``SequenceLayout.kernel``: ``auto`` (fused kernels: see ``attention_blocks.choose_block_kernel``), ``math``
(plain PyTorch, float32) or ``flex`` (document-masked sub-blocks by FlexAttention on any device, for tests)."""


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2*cp``) that ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def mask_kind(device, kernel: str) -> str:
    """How masked sub-blocks are given: ``flex`` (a ``BlockMask``) on CUDA or when forced, else ``dense``."""
    if kernel not in KERNELS:
        raise ValueError(f"context-parallel kernel '{kernel}' is not one of {', '.join(KERNELS)}")
    return "flex" if kernel == "flex" or (kernel == "auto" and torch.device(device).type == "cuda") else "dense"


def classify(first: list[list[int]] | None, last: list[list[int]] | None, q_chunk: int, kv_chunk: int) -> str:
    """``skip``, ``full``, ``causal`` or ``masked`` for one sub-block, from each row's first and last
    document id per chunk (``first[row][chunk]``); without documents (one per row) pass None."""
    if kv_chunk > q_chunk:
        return "skip"
    if first is None:
        return "causal" if kv_chunk == q_chunk else "full"
    rows = range(len(first))
    if kv_chunk == q_chunk:
        return "causal" if all(first[r][q_chunk] == last[r][q_chunk] for r in rows) else "masked"
    if all(last[r][kv_chunk] < first[r][q_chunk] for r in rows):  # ids never decrease along a row
        return "skip"
    if all(first[r][kv_chunk] == last[r][q_chunk] for r in rows):  # one document spans both chunks
        return "full"
    return "masked"


def plan_sub_blocks(layout, device) -> dict[int, list[tuple[int, int, object]]]:
    """Per source rank: (query half, key half, mask) of every sub-block of the local queries x that rank's
    keys that the masks do not hide entirely."""
    device = torch.device(device)
    kind = mask_kind(device, layout.kernel)
    chunks, c = 2 * layout.cp, layout.seq_len // (2 * layout.cp)
    docs = None if layout.document_ids is None else layout.document_ids.to(device)
    first = last = None
    if docs is not None:
        ends = docs.reshape(docs.shape[0], chunks, c)
        first, last = torch.stack([ends[:, :, 0], ends[:, :, -1]]).tolist()  # the one host sync
    plan = {}
    for source in range(layout.cp):
        blocks = []
        for qi, q_chunk in enumerate(chunk_ids(layout.cp, layout.rank)):
            for ki, kv_chunk in enumerate(chunk_ids(layout.cp, source)):
                what = classify(first, last, q_chunk, kv_chunk)
                if what == "skip":
                    continue
                if what == "masked":
                    build = chunk_block_mask if kind == "flex" else dense_chunk_mask
                    q_docs, kv_docs = (docs[:, i * c : (i + 1) * c] for i in (q_chunk, kv_chunk))
                    mask = build(q_docs, kv_docs, q_chunk == kv_chunk)
                else:
                    mask = "causal" if what == "causal" else None
                blocks.append((qi, ki, mask))
        plan[source] = blocks
    return plan


def sub_blocks(layout, device) -> dict[int, list[tuple[int, int, object]]]:
    """The micro-batch's plan for ``device``, made on first use and kept in ``layout.attention_cache``."""
    key = ("cp", str(torch.device(device)), mask_kind(device, layout.kernel))
    if key not in layout.attention_cache:
        layout.attention_cache[key] = plan_sub_blocks(layout, device)
    return layout.attention_cache[key]


def dense_chunk_mask(q_docs: torch.Tensor, kv_docs: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """(B, Lq, Lk) bool: same document (and causal on the diagonal)."""
    visible = q_docs[:, :, None] == kv_docs[:, None, :]
    if diagonal:
        length = q_docs.shape[1]
        visible = visible & torch.ones(length, length, dtype=torch.bool, device=visible.device).tril()
    return visible


def chunk_block_mask(
    q_docs: torch.Tensor, kv_docs: torch.Tensor, diagonal: bool, block_size: int = BLOCK_SIZE
) -> BlockMask:
    """FlexAttention ``BlockMask`` of ``dense_chunk_mask`` from per-tile document ranges (no Lq x Lk tensor).
    Off the diagonal every key precedes every query: a tile pair shares a document iff its last key's id
    reaches the first query's, and is full iff its first key's id equals the last query's."""
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
    kv_num, kv_index = _ordered(visible & ~full)
    full_num, full_index = _ordered(full)
    # Padding reads of the mask_mod see ids that match nothing: queries a new document, keys -1.
    pad = blocks * block_size - length
    q_padded = torch.cat([q_docs, (q_docs[:, -1:] + 1).expand(-1, pad)], dim=1)
    kv_padded = torch.cat([kv_docs, kv_docs.new_full((batch, pad), -1)], dim=1)
    return BlockMask.from_kv_blocks(
        kv_num, kv_index, full_num, full_index, BLOCK_SIZE=block_size,
        mask_mod=_chunk_mask_mod(q_padded, kv_padded, diagonal), seq_lengths=(length, length),
    )


def _chunk_mask_mod(q_docs: torch.Tensor, kv_docs: torch.Tensor, diagonal: bool):
    if diagonal:
        def causal_same_document(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_docs[b, q_idx] == kv_docs[b, kv_idx])

        return causal_same_document

    def same_document(b, h, q_idx, kv_idx):
        return q_docs[b, q_idx] == kv_docs[b, kv_idx]

    return same_document
