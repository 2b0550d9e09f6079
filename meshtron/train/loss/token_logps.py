"""Each label's log-probability under the head, chunk by chunk: what preference objectives sum per answer.

``head_token_logps`` takes the inputs of ``head_loss_sum`` (meshtron.train.loss.head) and returns, instead of one
summed loss, the float32 log-probability of every label (0 where the label is IGNORE_INDEX). Like the fused loss
(meshtron.train.loss.fused) it never holds a ``[tokens, vocab]`` tensor beyond one chunk: forward computes each
chunk's log-softmax at the labels and drops the logits; backward, given each token's upstream gradient ``g``,
computes each chunk's logits again and turns ``g * (one_hot - softmax)`` into the hidden-state and head gradients.
Unlike the fused loss, whose gradient does not depend on what comes after it, the upstream gradient here is only
known in backward, hence the recomputation (one more head matmul per chunk).

Under tensor parallelism the head weight is split over the vocabulary (``Shard(0)``): row maxima, exponential sums
and target logits are all-reduced over the split, every rank gets the whole result, and the hidden-state gradient
leaves as a partial sum, as the fused loss does.
"""

from __future__ import annotations

import functools

import torch

from meshtron.train.loss.fused import ChunkGradients, chunk_statistics, vocabulary_slices
from meshtron.train.loss.head import _replicated


def _chunk_logps(hidden, weight, bias, labels, vocab_start: int, softcap, group, upstream):
    """Float32 log-probabilities of one chunk's labels and, given ``upstream`` (the chunk's per-token gradient),
    the gradient of ``sum(upstream * logps)`` with respect to the chunk's logits (in ``weight``'s dtype);
    ``group``: the vocabulary-split ranks to reduce statistics over."""
    stats = chunk_statistics(hidden, weight, bias, labels, vocab_start, softcap, group)
    logps = (stats.target - stats.row_max - stats.sum_exp.log()) * stats.valid
    if upstream is None:
        return logps, None
    scale = upstream.float() * stats.valid
    probs = stats.probs.mul_((-scale / stats.sum_exp).unsqueeze(1))  # -g * softmax
    probs.scatter_add_(1, stats.index, (scale * stats.owned).unsqueeze(1))  # + g * one_hot (where owned)
    if stats.capped is not None:
        probs.mul_(1 - stats.capped * stats.capped)
    return logps, probs.to(weight.dtype)


@functools.cache
def _compiled_chunk():
    """``_chunk_logps`` compiled (made on first use: importing dynamo costs seconds an uncompiled run need not pay)."""
    return torch.compile(_chunk_logps, dynamic=False)


def _chunk_function(compiled: bool, group):
    return _compiled_chunk() if compiled and group is None else _chunk_logps


def _cast(hidden, weight, bias, compute_dtype):
    compute = compute_dtype or weight.dtype
    return hidden.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None


def _forward_logps(hidden, weight, bias, labels, chunk_size, vocab_start, softcap, group, chunk_fn):
    """(tokens,) float32 log-probabilities, chunk by chunk (``hidden``, ``weight``, ``bias`` already cast)."""
    out = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, labels.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        out[part] = chunk_fn(hidden[part], weight, bias, labels[part], vocab_start, softcap, group, None)[0]
    return out


class _HeadTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, compute_dtype, vocab_start, softcap, group, compiled):
        h, w, b = _cast(hidden, weight, bias, compute_dtype)
        chunk_fn = _chunk_function(compiled, group)
        logps = _forward_logps(h, w, b, labels, chunk_size, vocab_start, softcap, group, chunk_fn)
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.settings = (chunk_size, compute_dtype, vocab_start, softcap, group, compiled)
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        # Saved tensors are only read: zero-bubble pipeline schedules call this twice (input gradients, then weight
        # gradients), and each call recomputes the chunks from them.
        hidden, weight, bias, labels = ctx.saved_tensors
        chunk_size, compute_dtype, vocab_start, softcap, group, compiled = ctx.settings
        h, w, b = _cast(hidden, weight, bias, compute_dtype)
        chunk_fn = _chunk_function(compiled, group)
        grads = ChunkGradients(h, ctx.needs_input_grad[:3])
        for start in range(0, labels.shape[0], chunk_size):
            part = slice(start, start + chunk_size)
            _, grad_logits = chunk_fn(h[part], w, b, labels[part], vocab_start, softcap, group, grad_logps[part])
            grads.add(part, grad_logits, h, w)
            del grad_logits
        # Each gradient is rounded to the compute dtype once, as the fused loss rounds its own (see fused.py).
        return (
            grads.hidden.to(hidden.dtype) if grads.hidden is not None else None,
            _rounded(grads.weight, weight, w.dtype) if grads.want_weight else None,
            _rounded(grads.bias, bias, w.dtype) if grads.want_bias else None,
            *([None] * 7),
        )


def _rounded(grad: torch.Tensor | None, param: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    if grad is None:  # no tokens
        return torch.zeros_like(param)
    return grad.to(compute).to(param.dtype)


def head_token_logps(
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
    """Float32 log-probability of each label under ``hidden @ weight.T (+ bias)``: shape ``(labels.numel(),)`` in
    ``labels.flatten()``'s order, 0.0 where the label is IGNORE_INDEX; a plain tensor, whole on every rank.

    The arguments are ``head_loss_sum``'s: ``hidden`` (B, S, H), possibly a sequence-parallel DTensor; ``weight``
    possibly vocabulary-sharded (tensor parallelism), whose statistics are then reduced over the split whether or
    not ``loss_parallel`` is on (the arithmetic is the loss-parallel one either way); ``chunk_size`` tokens per chunk
    (0: one chunk); ``softcap``: logits become ``softcap * tanh(logits / softcap)``; ``compiled``: compile the chunk
    (``train.compile``). Without autograd (a reference model, evaluation) only the forward is computed.
    """
    del loss_parallel  # the same arithmetic with or without it (see the docstring)
    hidden = _replicated(hidden, weight).flatten(0, 1)
    labels = labels.flatten()
    hidden, weight, bias, group, vocab_start = vocabulary_slices(hidden, weight, bias)
    chunk_size = chunk_size if chunk_size > 0 else max(labels.shape[0], 1)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if needs_grad:
        return _HeadTokenLogps.apply(
            hidden, weight, bias, labels, chunk_size, compute_dtype, vocab_start, softcap, group, compiled
        )
    h, w, b = _cast(hidden, weight, bias, compute_dtype)
    return _forward_logps(h, w, b, labels, chunk_size, vocab_start, softcap, group, _chunk_function(compiled, group))
