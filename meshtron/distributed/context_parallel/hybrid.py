"""Hybrid context parallelism (``parallel.cp_method=hybrid``): Ulysses inside groups of ``cp_ulysses`` consecutive
cp ranks (a node's fast links), ring attention across the groups (the 2-D sequence parallelism of USP and
DeepSpeed-ALST).

With ``U = cp_ulysses`` and ``R = cp / U`` groups, cp rank ``r = g U + u`` is rank u of Ulysses group g and rank g
of ring u. Nothing changes outside attention: rank r holds chunks r and ``2 cp - 1 - r`` of the sequence's ``2 cp``
(``layout``), and the model's tokens, positions and RoPE are those of that shard. Around attention:

1. One all-to-all inside the group (``ulysses.to_head_shards``) gives every rank the group's tokens for ``H / U``
   of the heads (KV heads repeated up to U when fewer, as Ulysses does).
2. The group's tokens are exactly two chunks of the ring's own load-balanced split of the sequence into ``2 R``
   chunks: group g holds cp chunks ``g U .. g U + U - 1`` (ring chunk g) and ``2 cp - U - g U .. 2 cp - 1 - g U``
   (ring chunk ``2 R - 1 - g``). So after a fixed permutation (``group_orders``) they are the local queries, keys
   and values of rank g of a ring of R (``ring_layout``), whose tiles, causal and document masks and sliding windows
   are planned on global positions as for any ring: exact, with no new masking code.
3. ``ring.context_parallel_attention`` across the R groups (K/V of ``H / U`` heads go round), then the reverse
   permutation and all-to-all give back the rank's shard of every head.

``U = cp`` is a ring of one (Ulysses, attention by tiles), ``U = 1`` the plain ring. Needs the heads (after tp's
split) divisible by U and KV heads divisible by U or dividing it (``ulysses.check_ulysses``), U dividing cp.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtron.distributed.context_parallel.layout import HybridGroups, SequenceLayout, local_token_index
from meshtron.distributed.context_parallel.ring import context_parallel_attention
from meshtron.distributed.context_parallel.ulysses import to_head_shards, to_sequence_shards
from meshtron.tensors import compile_disabled


def hybrid_groups(cp_mesh, ulysses: int) -> HybridGroups:
    """The Ulysses and ring groups of this rank from the 1-D cp mesh (every rank calls it, in the same order: it
    makes process groups), by DeviceMesh's unflatten into (ring, Ulysses) with Ulysses innermost."""
    ring = cp_mesh.size() // ulysses
    mesh = cp_mesh._unflatten(0, (ring, ulysses), ("cp_ring", "cp_ulysses"))
    return HybridGroups(ulysses, mesh["cp_ulysses"].get_group(), mesh["cp_ring"].get_group())


def ring_layout(layout: SequenceLayout) -> SequenceLayout:
    """The ring across the groups as a ``SequenceLayout`` of ``cp / U`` ranks (this rank's group index its rank), the
    same documents; each ring chunk's document bounds from the cp chunks it is made of (host lists: no device read).
    Made once per micro-batch (kept in ``layout.attention_cache``), so every layer reuses its tile plan."""
    key = "hybrid-ring"
    if key not in layout.attention_cache:
        u = layout.hybrid.ulysses
        bounds = layout.document_bounds
        if bounds is not None:  # ring chunk n = cp chunks n U .. n U + U - 1
            first, last = bounds
            bounds = [row[::u] for row in first], [row[u - 1 :: u] for row in last]
        layout.attention_cache[key] = dataclasses.replace(
            layout,
            cp=layout.cp // u,
            rank=layout.rank // u,
            group=layout.hybrid.ring_group,
            method="ring",
            document_bounds=bounds,
            hybrid=None,
            attention_cache={},
            document_ranges={},
        )
    return layout.attention_cache[key]


def group_orders(layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_ring, to_shards): indices that put the rank-major concatenation of the group's shards into the ring's
    local order (ring chunk g, then ring chunk 2R - 1 - g, each in sequence order), and back."""
    key = ("hybrid-orders", str(device))
    if key not in layout.attention_cache:
        u, seq = layout.hybrid.ulysses, layout.seq_len
        first = layout.rank - layout.rank % u
        shards = torch.cat([local_token_index(seq, layout.cp, first + i, device) for i in range(u)])
        ring = local_token_index(seq, layout.cp // u, layout.rank // u, device)
        where = torch.empty(seq, dtype=torch.long, device=device)
        where[shards] = torch.arange(shards.numel(), device=device)
        to_ring = where[ring]
        where[ring] = torch.arange(ring.numel(), device=device)
        layout.attention_cache[key] = (to_ring, where[shards])
    return layout.attention_cache[key]


@compile_disabled
def hybrid_attention(
    q, k, v, layout: SequenceLayout, scale: float, window: int | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal (and document-masked, windowed) attention of this rank's sequence shard, all heads: (B, H, L, D);
    ``sinks`` (H,): gpt-oss's attention sinks (the ring merges this rank's heads' slice)."""
    u, group = layout.hybrid.ulysses, layout.hybrid.ulysses_group
    to_ring, to_shards = group_orders(layout, q.device)
    q, k, v, sinks = to_head_shards(q, k, v, u, group, to_ring, sinks)
    out = context_parallel_attention(q, k, v, ring_layout(layout), scale, window, sinks)
    return to_sequence_shards(out, u, group, to_shards)
