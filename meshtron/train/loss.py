"""The loss: the head and cross-entropy over the final hidden states, chunk by chunk.

``head_loss_sum`` is the one loss function of every layout (pipeline last stages included). It
applies the head itself instead of taking the model's logits, so that the full ``tokens x vocab``
logits, their float32 copy and softmax never exist at once: the tokens are cut into chunks of
``chunk_size``; each chunk's logits are computed, turned into a summed cross-entropy in float32 and
dropped, and recomputed in backward (activation checkpointing per chunk). What autograd keeps is the
hidden states (already kept by the final norm) and the head weight. The result is exact: the same
sums as one big cross-entropy, in another order.

Under tensor parallelism the head weight is vocab-sharded; with loss parallel the cross-entropy runs
on vocab-sharded logits (inside ``torch.distributed.tensor.parallel.loss_parallel``, which the
caller holds around forward and backward), otherwise each chunk's logits are gathered first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label value that carries no loss."""


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias, loss_parallel: bool, softcap=None):
    logits = F.linear(hidden, weight, bias)
    if isinstance(logits, DTensor) and not loss_parallel:
        logits = logits.full_tensor()
    logits = logits.float()
    if softcap:  # the model's final logit soft-capping (adapter.logit_softcap)
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _replicated(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The hidden states as the head needs them: whole sequences (gathered from sequence-parallel
    shards) and, next to a tensor-parallel weight, as a replicated DTensor."""
    if isinstance(hidden, DTensor):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    if isinstance(weight, DTensor):
        return DTensor.from_local(hidden, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False)
    return hidden


def head_loss_sum(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    chunk_size: int = 0,
    loss_parallel: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Summed cross-entropy (float32) of ``hidden @ weight.T (+ bias)`` against ``labels`` (B, S).

    ``compute_dtype``: the head computes in this dtype (mixed precision), gradients reach ``weight``
    in its own dtype. ``chunk_size``: tokens per chunk (0: one chunk, nothing recomputed).
    ``softcap``: logits become ``softcap * tanh(logits / softcap)`` first (``adapter.logit_softcap``).
    """
    if compute_dtype is not None:
        weight = weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    hidden = _replicated(hidden, weight).flatten(0, 1)
    labels = labels.flatten()
    tokens = labels.shape[0]
    if chunk_size <= 0 or tokens <= chunk_size:
        return _chunk_loss(hidden, labels, weight, bias, loss_parallel, softcap)
    total = None
    for start in range(0, tokens, chunk_size):
        part = checkpoint(
            _chunk_loss, hidden[start:start + chunk_size], labels[start:start + chunk_size], weight, bias,
            loss_parallel, softcap, use_reentrant=False,
        )
        total = part if total is None else total + part
    return total
