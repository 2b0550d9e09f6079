"""The chunked head + cross-entropy with its gradients written in the forward pass (fused linear cross-entropy).

For each chunk of tokens: the chunk's logits (``hidden @ weight.T``, compute dtype), their float32
log-sum-exp, the summed loss, and at once the gradient of that sum with respect to the logits
(``softmax - one_hot``), turned into the chunk's hidden-state gradient and added into a float32
weight-gradient accumulator. The chunk's logits are then dropped. Backward only multiplies the stored
gradients by the incoming scalar. Compared with checkpointing each chunk and recomputing it in backward
(what meshtron did before), the head costs three matmuls instead of four and no softmax runs twice; the
peak is one chunk's logits plus the two gradient buffers (``tokens x hidden`` and ``vocab x hidden``).
This is the approach of Liger-Kernel's fused linear cross-entropy, written in plain PyTorch so that it
runs on CPU and under DTensor tensor parallelism; ``compiled`` hands each chunk to ``torch.compile``,
which fuses the elementwise passes into a few kernels.

Under tensor parallelism the head weight is split over the vocabulary (``Shard(0)``): each rank computes
its vocabulary slice's logits; the row maxima, exponential sums and target logits are all-reduced over
the tensor-parallel group, so every rank holds the whole loss, and the hidden-state gradient leaves as a
partial sum (DTensor reduces it), whether or not ``parallel.loss_parallel`` is on: the arithmetic is the
loss-parallel one in both cases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshtron.data.labels import IGNORE_INDEX
from meshtron.tensors import local_tensor


@dataclass
class ChunkStatistics:
    """One chunk's softmax statistics over the whole vocabulary (reduced over its split under tensor parallelism)."""

    probs: torch.Tensor
    """``exp(logits - row_max)``, float32, this rank's vocabulary slice (the logits' own storage)."""
    row_max: torch.Tensor
    sum_exp: torch.Tensor
    target: torch.Tensor
    """Each token's label logit (0 where ignored)."""
    valid: torch.Tensor
    """Tokens whose label is not IGNORE_INDEX."""
    owned: torch.Tensor
    """Valid tokens whose label is in this rank's vocabulary slice."""
    index: torch.Tensor
    """(tokens, 1) the label's column in this slice (0 where not owned)."""
    capped: torch.Tensor | None
    """``tanh(logits / softcap)`` with soft-capping, else None."""


def head_logits(hidden, weight, bias, softcap) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(float32 logits of ``hidden @ weight.T (+ bias)``, soft-capped; ``tanh(logits / softcap)`` or None): the
    chunk's logits as every chunked head loss computes them (in the inputs' dtype, then float32)."""
    logits = F.linear(hidden, weight, bias).float()
    capped = None
    if softcap:  # the model's final logit soft-capping (adapter.logit_softcap)
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    return logits, capped


def chunk_statistics(hidden, weight, bias, labels, vocab_start: int, softcap, group) -> ChunkStatistics:
    """The chunk's logits (compute dtype, then float32, soft-capped), their row maxima, exponential sums and label
    logits, reduced over ``group`` (the vocabulary-split ranks; None: whole here). Shared by the fused loss and the
    per-token log-probabilities (meshtron.train.loss.token_logps)."""
    logits, capped = head_logits(hidden, weight, bias, softcap)
    valid = labels != IGNORE_INDEX
    local = labels - vocab_start
    owned = valid & (local >= 0) & (local < logits.shape[1])
    index = torch.where(owned, local, 0).unsqueeze(1)
    target = logits.gather(1, index).squeeze(1) * owned
    row_max = logits.detach().amax(1)
    if group is not None:
        dist.all_reduce(row_max, dist.ReduceOp.MAX, group=group)
    probs = logits.sub_(row_max.unsqueeze(1)).exp_()  # in place: the float32 logits are not needed again
    sums = torch.stack([probs.sum(1), target])
    if group is not None:
        dist.all_reduce(sums, group=group)
    return ChunkStatistics(probs, row_max, sums[0], sums[1], valid, owned, index, capped)


def _chunk(hidden, weight, bias, labels, vocab_start: int, softcap, group, with_grads: bool):
    """Summed loss of one chunk and, with ``with_grads``, the gradient of that sum with respect to the
    chunk's logits (compute dtype); ``group``: the vocabulary-split ranks to reduce statistics over."""
    stats = chunk_statistics(hidden, weight, bias, labels, vocab_start, softcap, group)
    loss = ((stats.row_max + stats.sum_exp.log() - stats.target) * stats.valid).sum()
    if not with_grads:
        return loss, None
    probs = stats.probs.div_(stats.sum_exp.unsqueeze(1))
    probs.scatter_add_(1, stats.index, -stats.owned.unsqueeze(1).to(probs.dtype))  # softmax - one_hot (where owned)
    probs.mul_(stats.valid.unsqueeze(1))
    if stats.capped is not None:
        probs.mul_(1 - stats.capped * stats.capped)
    return loss, probs.to(weight.dtype)


def _add_float32(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """``total + part`` in float32, in place; ``part`` itself (in float32) when there is no total yet: a loss of one
    chunk makes its weight gradient without a zero-filled buffer and an addition over the whole head."""
    if total is None:
        return part.float()
    return total.add_(part)


def _scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(grad * scale).to(dtype)`` in one pass: the product is computed in ``grad``'s dtype and rounded once as it
    is written (the same values as multiplying, then casting)."""
    if grad.dtype == dtype or isinstance(grad, DTensor):
        return (grad * scale).to(dtype)
    return torch.mul(grad, scale, out=torch.empty_like(grad, dtype=dtype))


@functools.cache
def _compiled_chunk():
    """``_chunk`` compiled (made on first use: importing dynamo costs seconds that an uncompiled run need not pay)."""
    return torch.compile(_chunk, dynamic=False)


class ChunkGradients:
    """The gradients a chunked head writes chunk by chunk from each chunk's gradient with respect to its logits: the
    hidden states' (written in place, in the compute dtype) and the head weight's and bias's (float32 sums over the
    chunks; the first chunk's is assigned, not added). Shared by the fused cross-entropy, the per-token
    log-probabilities (meshtron.train.loss.token_logps) and the distillation loss (meshtron.train.loss.distill)."""

    def __init__(self, h: torch.Tensor, wanted) -> None:
        want_hidden, self.want_weight, self.want_bias = wanted
        self.hidden = torch.empty_like(h) if want_hidden else None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def add(self, part: slice, grad_logits: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """Chunk ``part``'s share, from ``grad_logits`` (the chunk's, in ``w``'s dtype)."""
        if self.hidden is not None:
            torch.matmul(grad_logits, w, out=self.hidden[part])
        if self.want_weight:
            self.weight = _add_float32(self.weight, grad_logits.t() @ h[part])
        if self.want_bias:
            self.bias = _add_float32(self.bias, grad_logits.sum(0))

    def sums_or_zeros(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """(weight, bias) gradient sums, float32 zeros where wanted and no chunk had tokens."""
        if self.want_weight and self.weight is None:
            self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if self.want_bias and self.bias is None:
            self.bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        return self.weight, self.bias


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, compute_dtype, vocab_start, softcap, group, compiled):
        compute = compute_dtype or weight.dtype
        w = weight.to(compute)
        b = bias.to(compute) if bias is not None else None
        h = hidden.to(compute)
        chunk_fn = _compiled_chunk() if compiled and group is None else _chunk
        grads = ChunkGradients(h, ctx.needs_input_grad[:3])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, labels.shape[0], chunk_size):
            part = slice(start, start + chunk_size)
            loss, grad_logits = chunk_fn(h[part], w, b, labels[part], vocab_start, softcap, group, True)
            total += loss
            grads.add(part, grad_logits, h, w)
            del grad_logits
        ctx.save_for_backward(grads.hidden, *grads.sums_or_zeros(weight, bias))
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.compute = compute
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        # Not in place: zero-bubble pipeline schedules call this twice (input gradients, then weight gradients).
        # Each gradient is rounded to the compute dtype once, as FSDP's compute-dtype head parameters round theirs,
        # so that every layout (FSDP or meshtron's own casts) rounds the same and an fp16 overflow happens in all.
        wanted = ctx.needs_input_grad
        scaled = [
            None if grad is None or not want else _scaled(grad, grad_loss, ctx.compute).to(dtype)
            for grad, dtype, want in (
                (grad_hidden, hidden_dtype, wanted[0]),
                (grad_weight, weight_dtype, wanted[1]),
                (grad_bias, bias_dtype, wanted[2]),
            )
        ]
        return (*scaled, None, None, None, None, None, None, None)


def _vocabulary_split(weight: torch.Tensor):
    """(mesh dim, process group, first vocabulary row of this rank) of a ``Shard(0)`` DTensor head weight."""
    shard_dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    if (
        len(shard_dims) != 1
        or weight.placements[shard_dims[0]].dim != 0
        or any(not isinstance(p, (Shard, Replicate)) for p in weight.placements)
    ):
        raise ValueError(f"the fused loss needs a head weight split over the vocabulary only, got {weight.placements}")
    dim = shard_dims[0]
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return dim, weight.device_mesh.get_group(dim), offset[0]


def vocabulary_slices(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(hidden, weight, bias, group, vocab_start) as a chunked head computes with them: next to a vocabulary-sharded
    DTensor ``weight``, this rank's slices of the weight and bias as plain tensors, the hidden states whole (their
    gradient leaving as a partial sum over the split), the split's process group and this rank's first vocabulary
    row; otherwise the inputs themselves, None and 0."""
    if not isinstance(weight, DTensor):
        return hidden, weight, bias, None, 0
    dim, group, vocab_start = _vocabulary_split(weight)
    mesh = weight.device_mesh
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()] * mesh.ndim, run_check=False)
    # Each rank's hidden-state gradient is its vocabulary slice's share: a partial sum over the split.
    hidden = hidden.to_local(grad_placements=[Partial() if i == dim else Replicate() for i in range(mesh.ndim)])
    return hidden, weight.to_local(), local_tensor(bias), group, vocab_start


def fused_head_loss_sum(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    chunk_size: int,
    compute_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Summed float32 cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, chunk by chunk.

    ``hidden``: (tokens, hidden), a plain tensor or (next to a vocab-sharded DTensor ``weight``) a replicated
    DTensor; ``labels``: (tokens,). The result is a plain tensor, the whole loss on every rank. Without
    autograd (evaluation) only the loss is computed.
    """
    hidden, weight, bias, group, vocab_start = vocabulary_slices(hidden, weight, bias)
    chunk_size = chunk_size if chunk_size > 0 else max(labels.shape[0], 1)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if needs_grad:
        return _FusedLinearCrossEntropy.apply(
            hidden, weight, bias, labels, chunk_size, compute_dtype, vocab_start, softcap, group, compiled
        )
    compute = compute_dtype or weight.dtype
    w, h = weight.to(compute), hidden.to(compute)
    b = bias.to(compute) if bias is not None else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, labels.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        total += _chunk(h[part], w, b, labels[part], vocab_start, softcap, group, False)[0]
    return total
