"""Context-parallel attention: each sequence split over the ``cp`` ranks (``layout``), with exact attention
across them.

Attention (``context_parallel_attention``) computes the rank's queries against every rank's key /
value chunks tile by tile (a tile: one query chunk against one key chunk), skipping tiles that the causal
mask, the document mask or the layer's sliding window hides entirely, and merges the partial results by
log-sum-exp. Which tiles to compute and their masks are planned once per micro-batch and window
(``tiles``); each tile runs a fused kernel where the device has one (``tile_kernels``). The window is decided on
global token indices: a rank's two query chunks and every key chunk have known global offsets. Two ways
to get the other ranks' K/V:

* ``ring``: each rank's K/V travel around the ring with point-to-point ops; the next rank's K/V arrive
  while the current ones' tiles are computed. In backward the K/V gradients travel with their K/V and
  arrive home after a full turn. Memory: two ranks' K/V at a time.
* ``allgather``: one all-gather of K/V (small with grouped-query attention), and one reduce-scatter
  of their gradients in backward. Memory: the whole sequence's K/V on every rank.

Both are written as one autograd function with an explicit backward, so the autograd graph holds
only q, k, v, the output and the log-sum-exp of the local chunks. Attention sinks (gpt-oss) are one more term of
the final merge; the tiles' backward then reads the sink-inclusive output and log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.distributed.context_parallel.layout import SequenceLayout
from meshtron.distributed.context_parallel.tile_kernels import (
    add_sinks,
    merge_partial,
    sink_gradient,
    tile_backward,
    tile_forward,
)
from meshtron.distributed.context_parallel.tiles import planned_tiles
from meshtron.distributed.mesh import is_fake_group
from meshtron.models.attention_kernels import effective_window
from meshtron.tensors import compile_disabled


def _halves(t: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    return [t[:, :, :chunk], t[:, :, chunk:]]


def _peer(layout: SequenceLayout, offset: int) -> int:
    return dist.get_global_rank(layout.group, (layout.rank + offset) % layout.cp)


def _exchange(send: torch.Tensor, layout: SequenceLayout) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next rank and receiving the previous rank's into a new buffer."""
    received = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, _peer(layout, 1), layout.group),
        dist.P2POp(dist.irecv, received, _peer(layout, -1), layout.group),
    ]
    requests = dist.batch_isend_irecv(ops)
    if is_fake_group(layout.group):  # a rehearsal: the receive gave zeros (meshtron.distributed.one_rank_group),
        received.copy_(send)  # so "receive" this rank's own keys and values, as the all-gather hands them back
    return received, requests


def _finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
    """Wait for an ``_exchange`` and return what it received."""
    received, requests = pending
    for request in requests:
        request.wait()
    return received


def _forward_tiles(q_halves, kv, source: int, layout, scale, state, window=None) -> None:
    """Attend the local queries to the K/V chunks of rank ``source``, tile by tile, merging into ``state``."""
    k_halves, v_halves = _halves(kv[0], layout.chunk), _halves(kv[1], layout.chunk)
    for qi, ki, mask in planned_tiles(layout, q_halves[0].device, window)[source]:
        out, lse = tile_forward(q_halves[qi], k_halves[ki], v_halves[ki], mask, scale, layout.kernel)
        out_acc, lse_acc = state[qi]
        state[qi] = merge_partial(out_acc, lse_acc, out, lse)


def _backward_tiles(
    q_halves, kv, source: int, layout, scale, outs, lses, grad_outs, dq_halves, window=None
) -> torch.Tensor:
    """Add the local queries' gradient from rank ``source``'s K/V and return that K/V's gradient (2, ...)."""
    c = layout.chunk
    k_halves, v_halves = _halves(kv[0], c), _halves(kv[1], c)
    grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for qi, ki, mask in planned_tiles(layout, kv.device, window)[source]:
        dq, dk, dv = tile_backward(
            q_halves[qi], k_halves[ki], v_halves[ki], mask, scale, outs[qi], lses[qi], grad_outs[qi], layout.kernel
        )
        dq_halves[qi] += dq
        grad_kv[0, :, :, ki * c : (ki + 1) * c] += dk
        grad_kv[1, :, :, ki * c : (ki + 1) * c] += dv
    return grad_kv


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: SequenceLayout, scale: float, window: int | None = None, sinks=None):
        c = layout.chunk
        q_halves = _halves(q, c)
        kv = torch.stack([k, v]).contiguous()
        state = [
            (
                torch.zeros(h.shape, dtype=torch.float32, device=q.device),
                torch.full(h.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device),
            )
            for h in q_halves
        ]
        if layout.method == "allgather" and layout.cp > 1:
            gathered = _all_gather_kv(kv, layout)
            for source in _own_first(layout):
                _forward_tiles(q_halves, gathered[source], source, layout, scale, state, window)
        else:
            current = kv
            for step, source in enumerate(_own_first(layout)):
                pending = _exchange(current, layout) if step < layout.cp - 1 else None
                _forward_tiles(q_halves, current, source, layout, scale, state, window)
                if pending is not None:
                    current = _finish(pending)
        out = torch.cat([s[0] for s in state], dim=2)
        lse = torch.cat([s[1] for s in state], dim=2)
        if sinks is not None:  # one more term of every softmax's denominator (gpt-oss), no value
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # saved as returned: the backward kernels read it in the compute dtype
        ctx.save_for_backward(q, kv, out, lse, sinks)
        ctx.layout, ctx.scale, ctx.window = layout, scale, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse, sinks = ctx.saved_tensors
        layout, scale, window = ctx.layout, ctx.scale, ctx.window
        c = layout.chunk
        q_halves, outs, lses, grad_outs = _halves(q, c), _halves(out, c), _halves(lse, c), _halves(grad_out, c)
        dq_halves = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in q_halves]
        if layout.method == "allgather" and layout.cp > 1:
            gathered = _all_gather_kv(kv, layout)
            grads = torch.cat(
                [
                    _backward_tiles(q_halves, gathered[s], s, layout, scale, outs, lses, grad_outs, dq_halves, window)
                    for s in range(layout.cp)
                ]
            )
            grad_kv = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
            dist.reduce_scatter_tensor(grad_kv, grads, group=layout.group)
        else:
            current = kv
            grad_kv = None
            for step, source in enumerate(_own_first(layout)):
                pending = _exchange(current, layout) if step < layout.cp - 1 else None
                source_grad = _backward_tiles(
                    q_halves, current, source, layout, scale, outs, lses, grad_outs, dq_halves, window
                )
                if grad_kv is not None:  # the gradient these K/V gathered on the ranks before
                    source_grad += grad_kv
                if pending is not None:
                    current = _finish(pending)
                # Pass the K/V's gradient on; after a full turn it is home.
                grad_kv = _finish(_exchange(source_grad, layout)) if layout.cp > 1 else source_grad
        dq = torch.cat(dq_halves, dim=2).to(q.dtype)
        dsinks = sink_gradient(out, lse, grad_out, sinks) if sinks is not None else None  # this rank's queries'
        return dq, grad_kv[0].to(kv.dtype), grad_kv[1].to(kv.dtype), None, None, None, dsinks


def _all_gather_kv(kv: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Every rank's stacked K/V: (cp, 2, B, Hkv, L, D). Collectives concatenate along dim 0."""
    gathered = torch.empty((layout.cp * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    dist.all_gather_into_tensor(gathered, kv, group=layout.group)
    return gathered.view(layout.cp, *kv.shape)


def _own_first(layout: SequenceLayout) -> list[int]:
    """Source ranks with the local one first (the ring's arrival order), so the diagonal tiles start every
    query's running result."""
    return [(layout.rank - step) % layout.cp for step in range(layout.cp)]


@compile_disabled
def context_parallel_attention(
    q, k, v, layout: SequenceLayout, scale: float, window: int | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal (and document-masked) attention of the local queries over the whole sequence: (B, H, L, D);
    ``window``: the layer's sliding window (query index - key index < window, global indices) or None;
    ``sinks`` (H,): gpt-oss's attention sinks, merged into the final log-sum-exp (``tile_kernels.add_sinks``).
    Runs eagerly inside compiled blocks (its ring exchange and recomputing backward are not traceable).

    Values narrower than queries and keys (DeepSeek-V3's latent attention) travel zero-padded to their width, as
    keys and values move stacked; the padding's output columns are zero and dropped."""
    value_dim = v.shape[-1]
    if value_dim < k.shape[-1]:
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - value_dim))
    elif value_dim > k.shape[-1]:  # zero key columns add nothing to any score
        q, k = (torch.nn.functional.pad(t, (0, value_dim - t.shape[-1])) for t in (q, k))
    window = effective_window(window, layout.seq_len)
    out = _ContextParallelAttention.apply(q, k, v, layout, scale, window, sinks)
    return out[..., :value_dim]
