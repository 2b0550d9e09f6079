"""Fused kernels for one context-parallel tile: forward -> (out, log-sum-exp), and the backward of a
tile from the *final* output and log-sum-exp of its queries (what ring attention needs).

* ``flash``: PyTorch's flash-attention ops (CUDA, fp16 / bf16, sm80+, grouped-query heads natively).
* ``efficient``: PyTorch's memory-efficient ops (CUDA, fp32 or older GPUs; key/value heads repeated).
  Both ops return the log-sum-exp and have a backward that takes an output and log-sum-exp.
* ``flex``: FlexAttention with the tile's ``BlockMask`` (document-masked tiles; compiled on
  CUDA, eager elsewhere). Its backward takes only its own output and log-sum-exp, so the tile is
  recomputed in backward and differentiated through its output *and* its log-sum-exp
  (``recomputed_backward``): one extra forward of the masked tiles, never a score matrix.

On CUDA none of them materializes the (Lq, Lk) scores (eager FlexAttention, off CUDA, does). The CUDA
paths have not been run on a GPU yet: see docs/context-parallel.md.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from meshtron.models.attention_kernels import _compiled_flex

EFFICIENT_LSE_ALIGN = 32
"""The memory-efficient kernel pads its log-sum-exp to a multiple of this many queries (read in backward)."""


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradient of repeated key/value heads back onto each key/value head."""
    if groups == 1:
        return t
    batch, heads, length, dim = t.shape
    return t.reshape(batch, heads // groups, groups, length, dim).sum(2)


def flash_forward(q, k, v, causal: bool, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale
    )[:2]
    return out, lse


def flash_backward(q, k, v, causal: bool, scale: float, out, lse, grad_out):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    rng = q.new_empty(0, dtype=torch.int64)  # the rng state is read only with dropout
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.to(q.dtype).contiguous(),
        q,
        k,
        v,
        out.to(q.dtype).contiguous(),
        lse.float().contiguous(),
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        rng,
        rng,
        scale=scale,
    )


def efficient_forward(q, k, v, causal: bool, scale: float):
    groups = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(),
        expand_kv(k, groups).contiguous(),
        expand_kv(v, groups).contiguous(),
        None,
        True,
        0.0,
        causal,
        scale=scale,
    )[:2]
    return out, lse[..., : q.shape[2]]


def efficient_backward(q, k, v, causal: bool, scale: float, out, lse, grad_out):
    groups = q.shape[1] // k.shape[1]
    batch, heads, length, _ = q.shape
    padded = torch.zeros(
        batch, heads, -(-length // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN, dtype=torch.float32, device=q.device
    )
    padded[..., :length] = lse
    seed = q.new_zeros((), dtype=torch.int64)  # read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.to(q.dtype).contiguous(),
        q.contiguous(),
        expand_kv(k, groups).contiguous(),
        expand_kv(v, groups).contiguous(),
        None,
        out.to(q.dtype).contiguous(),
        padded,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, fold_kv(dk, groups), fold_kv(dv, groups)


def flex_forward(q, k, v, block_mask, scale: float):
    """(out, lse) of FlexAttention; differentiable when the inputs require grad (CUDA only)."""
    attend = _compiled_flex() if q.device.type == "cuda" else flex_attention
    out, aux = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def flex_backward(q, k, v, block_mask, scale: float, out, lse, grad_out):
    return recomputed_backward(lambda q, k, v: flex_forward(q, k, v, block_mask, scale), q, k, v, out, lse, grad_out)


def recomputed_backward(forward, q, k, v, out, lse, grad_out):
    """(dq, dk, dv) float32 of a tile whose ``forward(q, k, v) -> (out_t, lse_t)`` is differentiable.

    The merged output is ``out = sum_t w_t out_t`` with ``w_t = exp(lse_t - lse)``, so this tile gets
    ``d out_t = w_t d out`` and ``d lse_t = w_t (d out . (out_t - out))`` (rows it hides: ``w_t = 0``)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        tile_out, tile_lse = forward(*leaves)
        finite = torch.where(torch.isinf(lse), 0.0, lse)
        weight = torch.exp(tile_lse.float() - finite)
        grad_out = grad_out.float()
        grad_tile_out = weight[..., None] * grad_out
        grad_tile_lse = weight * (grad_out * (tile_out.float() - out.float())).sum(-1)
        grads = torch.autograd.grad(
            (tile_out, tile_lse),
            leaves,
            (grad_tile_out.to(tile_out.dtype), grad_tile_lse.to(tile_lse.dtype)),
        )
    return tuple(g.float() for g in grads)
