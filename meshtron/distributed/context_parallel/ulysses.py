"""Ulysses context parallelism (``parallel.cp_method=ulysses``): all-to-all from sequence shards to head shards.

Each cp rank holds its load-balanced share of every sequence (``layout``: chunks r and 2*cp-1-r) for all heads.
Around attention, one all-to-all turns that into the *whole* sequence for ``H / cp`` of the heads (rank r: heads
``[r H/cp, (r+1) H/cp)``), attention runs on whole sequences with the device's kernel (the document mask and the
layer's sliding window as without cp: every rank has the micro-batch's document ids), and a second all-to-all
turns the output back into sequence shards of every head. Both all-to-alls are differentiable, so backward is
their reverse around the kernel's own backward. Communication per layer: q, k, v and the output once each
(forward; the same in backward), independent of cp per rank, against ring's cp - 1 K/V steps.

Key / value heads: with ``Hkv % cp == 0`` each rank takes its ``Hkv / cp`` (a query head's key head stays with it);
with fewer (``cp % Hkv == 0``) each key head is repeated ``cp / Hkv`` times first, so every rank receives the one
its query heads use. Needs ``H % cp == 0`` (after tensor parallelism's split: the local heads).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd

from meshtron.distributed.context_parallel.layout import SequenceLayout, local_token_index
from meshtron.errors import ConfigError
from meshtron.models.attention_kernels import document_attention
from meshtron.tensors import compile_disabled


def check_ulysses(heads: int, kv_heads: int, cp: int, tp: int = 1, hybrid: bool = False) -> None:
    """Refuse, with one line, head counts Ulysses cannot split over ``cp`` ranks (after ``tp``'s split); ``hybrid``:
    ``cp`` is ``parallel.cp_ulysses``, the all-to-all degree of ``parallel.cp_method=hybrid``."""
    local, local_kv = heads // tp, max(kv_heads // tp, 1)
    method, setting = ("hybrid", "parallel.cp_ulysses") if hybrid else ("ulysses", "parallel.cp")
    if local % cp:
        fix = "a parallel.cp_ulysses that divides them"
        if not hybrid:
            fix = "parallel.cp_method=ring or a cp that divides them"
        raise ConfigError(
            f"parallel.cp_method={method} splits attention heads over {setting}={cp}, but this rank's {local} "
            f"query heads ({heads} / parallel.tp={tp}) are not divisible by it; use {fix}"
        )
    if local_kv % cp and cp % local_kv:
        fix = "a parallel.cp_ulysses that divides them or that they divide" if hybrid else "parallel.cp_method=ring"
        raise ConfigError(
            f"parallel.cp_method={method} needs key/value heads ({local_kv} per tp rank) divisible by {setting}={cp} "
            f"or dividing it; use {fix}"
        )


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(B, H, L, D) sequence shard of every head -> (B, H / cp, cp * L, D): every rank's shard of this rank's heads,
    rank-major along the sequence."""
    b, h, length, d = x.shape
    send = x.reshape(b, cp, h // cp, length, d).transpose(0, 1).contiguous()  # (cp, B, H/cp, L, D): one per rank
    received = all_to_all_single_autograd(send.reshape(-1), None, None, group)
    received = received.reshape(cp, b, h // cp, length, d)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * length, d)


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The reverse of ``_seq_to_heads``: (B, H / cp, cp * L, D) -> (B, H, L, D)."""
    b, h_local, total, d = x.shape
    length = total // cp
    send = x.reshape(b, h_local, cp, length, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, L, D)
    received = all_to_all_single_autograd(send.reshape(-1), None, None, group)
    received = received.reshape(cp, b, h_local, length, d)  # rank j's heads of this rank's shard
    return received.transpose(0, 1).reshape(b, cp * h_local, length, d)


def sequence_orders(layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_global, to_shards): indices that put the rank-major concatenation of every rank's shard into sequence
    order, and back (built once per micro-batch)."""
    key = ("ulysses-orders", str(device))
    if key not in layout.attention_cache:
        shards = torch.cat([local_token_index(layout.seq_len, layout.cp, r, device) for r in range(layout.cp)])
        to_global = torch.empty_like(shards)
        to_global[shards] = torch.arange(shards.numel(), device=device)
        layout.attention_cache[key] = (to_global, shards)
    return layout.attention_cache[key]


def to_head_shards(q, k, v, degree: int, group, order: torch.Tensor, sinks=None):
    """The all-to-all of Ulysses over ``degree`` ranks: this rank's sequence shard of every head (B, H, L, D) ->
    every rank's shard of this rank's ``H / degree`` heads, put in the sequence order ``order`` gives (an index
    into the rank-major concatenation of the shards), for q, k and v; KV heads fewer than ``degree`` repeated
    first. ``sinks`` (H,): this rank's heads' slice (None stays None)."""
    kv_heads = k.shape[1]
    check_ulysses(q.shape[1], kv_heads, degree)  # this rank's heads (preflight checked the model's already)
    if kv_heads % degree:  # fewer key/value heads than ranks: each rank receives the one its query heads use
        k, v = (t.repeat_interleave(degree // kv_heads, dim=1) for t in (k, v))
    if sinks is not None:  # this rank's heads: [r H/degree, (r+1) H/degree), as _seq_to_heads splits them
        sinks = sinks.reshape(degree, -1)[torch.distributed.get_rank(group)]
    q, k, v = (_seq_to_heads(t, degree, group).index_select(2, order) for t in (q, k, v))
    return q, k, v, sinks


def to_sequence_shards(out: torch.Tensor, degree: int, group, order: torch.Tensor) -> torch.Tensor:
    """The reverse of ``to_head_shards`` for the output: ``order`` puts it back rank-major, then the all-to-all."""
    return _heads_to_seq(out.index_select(2, order), degree, group)


@compile_disabled
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (and document-masked, windowed) attention of this rank's sequence shard, all heads: (B, H, L, D).
    ``sinks`` (H,): the heads' attention sinks (gpt-oss), of which this rank applies its own heads' slice. Runs
    eagerly inside compiled blocks, as the ring does."""
    cp, group = layout.cp, layout.group
    to_global, to_shards = sequence_orders(layout, q.device)
    q_all, k_all, v_all, sinks = to_head_shards(q, k, v, cp, group, to_global, sinks)
    kernel = "sdpa" if layout.kernel == "math" else layout.kernel  # the tiles' plain kernel: SDPA on whole sequences
    out = document_attention(
        q_all, k_all, v_all, layout.document_ids, scale, kernel, layout.attention_cache, window, softcap, sinks
    )
    return to_sequence_shards(out, cp, group, to_shards)
