"""Exact attention on one (query block, key/value block) pair, returning the log-sum-exp.

Context-parallel attention computes a rank's queries against key/value blocks one at a time and
merges the partial results by their log-sum-exp; the backward of a block needs the *final* output
and log-sum-exp of its queries. These kernels do both, in float32, for grouped-query attention
(``q``: ``(B, H, Lq, D)``, ``k``/``v``: ``(B, Hkv, Lk, D)``, ``H`` a multiple of ``Hkv``).

``mask`` is ``None`` (every key visible), the string ``"causal"`` (block on the diagonal) or a
boolean tensor broadcastable to ``(B, Lq, Lk)``, True where a query may attend a key. On CPU, blocks
without a tensor mask use PyTorch's flash kernel, which returns the log-sum-exp and has a backward
that takes the final output and log-sum-exp; everything else uses the plain-PyTorch kernel.
"""

from __future__ import annotations

import torch

Mask = torch.Tensor | str | None


def _use_cpu_flash(q: torch.Tensor, mask: Mask, kernel: str) -> bool:
    return kernel == "auto" and q.device.type == "cpu" and not isinstance(mask, torch.Tensor)


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


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradient of repeated key/value heads back onto each key/value head."""
    if groups == 1:
        return t
    batch, heads, length, dim = t.shape
    return t.reshape(batch, heads // groups, groups, length, dim).sum(2)


def block_forward(q, k, v, mask: Mask, scale: float, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, D), lse (B, H, Lq)), both float32; rows with no visible key get out 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]
    if _use_cpu_flash(q, mask, kernel):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, mask == "causal", scale=scale
        )[:2]
        return out.float(), lse.float()
    scores = _masked_scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.matmul(probs, v.float()[:, :, None])
    return out.flatten(1, 2), lse.flatten(1, 2)


def block_backward(q, k, v, mask: Mask, scale: float, out, lse, grad_out, kernel: str = "auto"):
    """(dq, dk, dv) float32 of this block's share, given the queries' final ``out`` and ``lse``."""
    groups = q.shape[1] // k.shape[1]
    if _use_cpu_flash(q, mask, kernel):
        dtype = q.dtype
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(dtype), q, _expand_kv(k, groups), _expand_kv(v, groups), out.to(dtype), lse,
            0.0, mask == "causal", scale=scale,
        )
        return dq.float(), _fold_kv(dk.float(), groups), _fold_kv(dv.float(), groups)
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


def merge_partial(out_acc, lse_acc, out_block, lse_block) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax-attention results over disjoint key sets by their log-sum-exp."""
    lse = torch.logaddexp(lse_acc, lse_block)
    finite = torch.where(torch.isinf(lse), 0.0, lse)  # both parts empty: keep 0, not NaN
    out = out_acc * torch.exp(lse_acc - finite)[..., None] + out_block * torch.exp(lse_block - finite)[..., None]
    return out, lse
