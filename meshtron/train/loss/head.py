"""The loss: the head and cross-entropy over the final hidden states.

``head_loss_sum`` is the one loss function of every layout (pipeline last stages included). It
applies the head itself instead of taking the model's logits. With ``train.loss_chunk_size`` > 0 (the
default) it is meshtron.train.loss.fused: the tokens are cut into chunks, each chunk's logits are
turned into its loss and its gradients at once and dropped, so the full ``tokens x vocab`` logits,
their float32 copy and softmax never exist and nothing is recomputed in backward. With 0 it is one
``F.linear`` + ``F.cross_entropy`` over all tokens.

Under tensor parallelism the head weight is vocab-sharded. The fused loss reduces its statistics over
the vocabulary split itself; the unchunked one, with loss parallel, runs on vocab-sharded logits (inside
``torch.distributed.tensor.parallel.loss_parallel``, which the caller holds around forward and
backward), otherwise on logits gathered first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from meshtron.data.labels import IGNORE_INDEX
from meshtron.train.loss.fused import fused_head_loss_sum

__all__ = ["IGNORE_INDEX", "head_loss_sum"]  # IGNORE_INDEX (-100): the label value that carries no loss


def _chunk_loss(
    hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias, loss_parallel: bool, softcap=None
):
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
    compiled: bool = False,
) -> torch.Tensor:
    """Summed cross-entropy (float32) of ``hidden @ weight.T (+ bias)`` against ``labels`` (B, S).

    ``compute_dtype``: the head computes in this dtype (mixed precision), gradients reach ``weight``
    in its own dtype. ``chunk_size``: tokens per chunk of the fused loss (0: all logits at once).
    ``softcap``: logits become ``softcap * tanh(logits / softcap)`` first (``adapter.logit_softcap``).
    ``compiled``: compile the fused loss's chunk (``train.compile``).
    """
    hidden = _replicated(hidden, weight).flatten(0, 1)
    labels = labels.flatten()
    if chunk_size > 0:
        return fused_head_loss_sum(
            hidden,
            labels,
            weight,
            bias,
            chunk_size=chunk_size,
            compute_dtype=compute_dtype,
            softcap=softcap,
            compiled=compiled,
        )
    if compute_dtype is not None:
        weight = weight.to(compute_dtype)
        bias = bias.to(compute_dtype) if bias is not None else None
    return _chunk_loss(hidden, labels, weight, bias, loss_parallel, softcap)
