"""Exact attention on one tile, a (query chunk, key/value chunk) pair, returning the log-sum-exp.

Context-parallel attention computes a rank's queries against key/value chunks one tile at a time and
merges the partial results by their log-sum-exp; the backward of a tile needs the *final* output
and log-sum-exp of its queries. These functions do both for grouped-query attention (``q``:
``(B, H, Lq, D)``, ``k``/``v``: ``(B, Hkv, Lk, D)``, ``H`` a multiple of ``Hkv``), returning float32.

``mask`` is ``None`` (every key visible), the string ``"causal"`` (tile on the diagonal), a boolean
tensor broadcastable to ``(B, Lq, Lk)`` (True where a query may attend a key) or a FlexAttention
``BlockMask``. ``choose_tile_kernel`` picks the kernel from the device, dtype and mask:

* CPU: PyTorch's CPU flash op for tiles without a tensor mask; the plain-PyTorch float32 kernel
  (``math``) for boolean masks.
* CUDA: the flash op (fp16 / bf16 on sm80+) or the memory-efficient op (otherwise) for tiles without
  a mask; FlexAttention for tiles with a ``BlockMask`` (``fused_tile_kernels``). Never run on a GPU yet.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch.nn.attention.flex_attention import BlockMask

from meshtron.distributed.context_parallel import fused_tile_kernels as fused
from meshtron.distributed.context_parallel.fused_tile_kernels import expand_kv, fold_kv

Mask: TypeAlias = torch.Tensor | BlockMask | str | None
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def choose_tile_kernel(
    device,
    dtype: torch.dtype,
    head_dim: int,
    mask: Mask,
    kernel: str = "auto",
    capability: tuple[int, int] | None = None,
) -> str:
    """``cpu_flash``, ``cuda_flash``, ``cuda_efficient``, ``flex`` or ``math`` for one tile.
    ``capability``: the CUDA device's (major, minor), looked up when None."""
    if isinstance(mask, BlockMask):
        return "flex"
    if kernel == "math" or isinstance(mask, torch.Tensor):
        return "math"
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda" and head_dim % 8 == 0 and head_dim <= 256:
        capability = capability or torch.cuda.get_device_capability(device)
        return "cuda_flash" if dtype in FLASH_DTYPES and capability >= (8, 0) else "cuda_efficient"
    return "math"


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, Hkv, G, L, D): query head h uses key/value head h // G."""
    batch, heads, length, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads, length, dim)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float) -> torch.Tensor:
    """Scores (B, Hkv, G, Lq, Lk) in float32, -inf where masked."""
    scores = torch.matmul(_grouped(q.float(), k.shape[1]), k.float()[:, :, None].transpose(-1, -2)) * scale
    if mask is None:
        return scores
    if isinstance(mask, str):
        length_q, length_k = scores.shape[-2:]
        visible = torch.ones(length_q, length_k, dtype=torch.bool, device=q.device).tril()
    else:
        visible = mask[:, None, None] if mask.dim() == 3 else mask
    return scores.masked_fill(~visible, float("-inf"))


def tile_forward(q, k, v, mask: Mask, scale: float, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, D), lse (B, H, Lq)), both float32; rows with no visible key get out 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]
    name = choose_tile_kernel(q.device, q.dtype, q.shape[-1], mask, kernel)
    causal = isinstance(mask, str) and mask == "causal"
    if name == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, expand_kv(k, groups), expand_kv(v, groups), 0.0, causal, scale=scale
        )[:2]
        return out.float(), lse.float()
    if name in ("cuda_flash", "cuda_efficient", "flex"):
        if name == "flex":  # detached: eager FlexAttention refuses inputs that require grad off CUDA
            out, lse = fused.flex_forward(q.detach(), k.detach(), v.detach(), mask, scale)
        else:
            out, lse = (fused.flash_forward if name == "cuda_flash" else fused.efficient_forward)(
                q, k, v, causal, scale
            )
        return out.float(), lse.float()
    return math_forward(q, k, v, mask, scale)


def math_forward(q, k, v, mask: Mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch float32 forward of ``tile_forward`` (differentiable)."""
    scores = _masked_scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(probs, v.float()[:, :, None])
    return out.flatten(1, 2), lse.flatten(1, 2)


def tile_backward(q, k, v, mask: Mask, scale: float, out, lse, grad_out, kernel: str = "auto"):
    """(dq, dk, dv) float32 of this tile's share, given the queries' final ``out`` and ``lse``."""
    groups = q.shape[1] // k.shape[1]
    name = choose_tile_kernel(q.device, q.dtype, q.shape[-1], mask, kernel)
    causal = isinstance(mask, str) and mask == "causal"
    if name == "cpu_flash":
        dtype = q.dtype
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(dtype),
            q,
            expand_kv(k, groups),
            expand_kv(v, groups),
            out.to(dtype),
            lse,
            0.0,
            causal,
            scale=scale,
        )
        return dq.float(), fold_kv(dk.float(), groups), fold_kv(dv.float(), groups)
    if name == "flex":
        return fused.flex_backward(q, k, v, mask, scale, out, lse, grad_out)
    if name in ("cuda_flash", "cuda_efficient"):
        backward = fused.flash_backward if name == "cuda_flash" else fused.efficient_backward
        dq, dk, dv = backward(q, k, v, causal, scale, out, lse, grad_out)[:3]
        return dq.float(), dk.float(), dv.float()
    kv_heads = k.shape[1]
    scores = _masked_scores(q, k, mask, scale)
    probs = torch.exp(scores - _grouped(lse[..., None], kv_heads))  # masked scores are -inf -> 0
    grad_out_g = _grouped(grad_out.float(), kv_heads)
    row_dot = _grouped((grad_out.float() * out.float()).sum(-1, keepdim=True), kv_heads)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, grad_out_g)
    grad_scores = probs * (torch.matmul(grad_out_g, v.float()[:, :, None].transpose(-1, -2)) - row_dot)
    dq = torch.matmul(grad_scores, k.float()[:, :, None]) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", grad_scores, _grouped(q.float(), kv_heads)) * scale
    return dq.flatten(1, 2), dk, dv


def merge_partial(out_acc, lse_acc, out_tile, lse_tile) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax-attention results over disjoint key sets by their log-sum-exp."""
    lse = torch.logaddexp(lse_acc, lse_tile)
    finite = torch.where(torch.isinf(lse), 0.0, lse)  # both parts empty: keep 0, not NaN
    out = out_acc * torch.exp(lse_acc - finite)[..., None] + out_tile * torch.exp(lse_tile - finite)[..., None]
    return out, lse


def add_sinks(out, lse, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """The final (out, lse) (B, H, L, D) / (B, H, L) of queries whose softmax also counts each head's sink logit
    ``sinks`` (H,) (gpt-oss), attending to no value: the sink merged as one more partial result of output 0,
    ``out * exp(lse - lse')`` = ``out * sigmoid(lse - sink)`` with ``lse' = logaddexp(lse, sink)``. The tiles'
    backward, given these, computes the q/k/v gradients of attention with sinks (the sink's value is 0)."""
    sink = sinks.float().reshape(1, -1, 1).expand(lse.shape)
    return merge_partial(out, lse, torch.zeros_like(out), sink)


def sink_gradient(out, lse, grad_out, sinks) -> torch.Tensor:
    """The loss's gradient (H,) with respect to the sinks, from ``add_sinks``' final ``out`` and ``lse`` and the
    output's gradient: the sink's probability ``exp(sink - lse)`` times (its value's 0 minus the row's
    ``sum(grad_out * out)``), summed over the batch and this rank's queries."""
    row_dot = (grad_out.float() * out.float()).sum(-1)
    probability = torch.exp(sinks.float().reshape(1, -1, 1) - lse)
    return -(probability * row_dot).sum(dim=(0, 2)).to(sinks.dtype)
