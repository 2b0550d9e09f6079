"""The distillation loss on the head: a frozen teacher's next-token distribution taught to the student, chunk by chunk.

Per labelled token (labels != IGNORE_INDEX), with ``s`` and ``t`` the student's and teacher's logits (each
soft-capped first when its model caps them), ``log p_s = log_softmax(s / T)`` and ``log p_t = log_softmax(t / T)``:

- ``forward_kl``: KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)  (TRL GKD's beta = 0)
- ``reverse_kl``: KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)  (beta = 1)
- ``jsd``: with the mixture m = log((1 - beta) p_s + beta p_t) (a log-sum-exp of the log-probabilities),
  beta KL(p_t || m) + (1 - beta) KL(p_s || m)  (0 < beta < 1)

exactly TRL's ``GKDTrainer.generalized_jsd_loss`` (no temperature^2 factor), and the loss is
``alpha * CE + (1 - alpha) * divergence`` summed over the tokens, CE being the head's cross-entropy (temperature 1).

``chunk_size > 0`` fuses it with the head as meshtron.train.loss.fused does for the cross-entropy: per chunk of
tokens, both models' logits (float32 statistics), the loss and at once its gradient with respect to the student's
logits, which is turned into the chunk's hidden-state gradient and added into a float32 weight-gradient
accumulator; both logits are dropped before the next chunk, and backward only scales the stored gradients. The
peak is about eight chunk-sized float32 buffers and the two gradient buffers, against about fifteen whole
``tokens x vocab`` float32 tensors unfused (bench/distill_memory.py). The gradients, written by hand (w.r.t. the
student's soft-capped logits, then times the soft-cap derivative):
forward KL ``(p_s - p_t) / T``; reverse KL and JSD ``p_s (g - sum_v p_s g) / T`` with ``g = log p_s - log p_t``
(reverse) or ``(1 - beta)(log p_s - m)`` (JSD); the cross-entropy's ``softmax - one_hot``. Under tensor parallelism
both heads are split over the vocabulary alike (``Shard(0)``): row maxima, exponential sums and the per-token
vocabulary sums are all-reduced over the split (three stacked all-reduces a chunk) and the hidden-state gradient
leaves as a partial sum. ``chunk_size == 0`` is the reference: whole logits (gathered under tensor parallelism)
and autograd.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshtron.data.labels import IGNORE_INDEX
from meshtron.train.loss.fused import ChunkGradients, _scaled, head_logits, vocabulary_slices
from meshtron.train.loss.head import _replicated

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillOptions:
    """What the student is taught: the divergence, its temperature and the cross-entropy's share."""

    divergence: str = "forward_kl"
    beta: float = 0.5
    """jsd only: TRL GKD's beta (0 < beta < 1), the teacher's weight in the mixture."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the softmaxes of the divergence."""
    alpha: float = 0.0
    """Weight of the ordinary next-token cross-entropy (temperature 1); (1 - alpha) weighs the divergence."""

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if self.divergence == "jsd" and not 0 < self.beta < 1:
            raise ValueError(f"jsd's beta must be strictly between 0 and 1, got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


def _reduced(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op, group=group)
    return tensor


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's ``sum_v a * b``, without a ``tokens x vocab`` product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _divergence_parts(log_ps, log_pt, ps, pt, options: DistillOptions) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(this vocabulary slice's per-token sums whose total is the divergence, the last being sum_v p_s g; g, or for
    the forward KL p_t). Overwrites ``log_ps`` and ``log_pt``, which are not needed again."""
    if options.divergence == "forward_kl":
        return [_row_dot(pt, log_pt.sub_(log_ps))], pt
    if options.divergence == "reverse_kl":
        g = log_ps.sub_(log_pt)
        return [_row_dot(ps, g)], g
    beta = options.beta
    mixture = log_ps + math.log1p(-beta)  # log((1 - beta) p_s + beta p_t), a log-sum-exp as TRL computes it
    log_beta = math.log(beta)
    torch.logaddexp(mixture, log_pt.add_(log_beta), out=mixture)  # log_pt shifted in place, not copied
    teacher_part = beta * _row_dot(pt, log_pt.sub_(log_beta).sub_(mixture))
    g = log_ps.sub_(mixture).mul_(1 - beta)
    return [teacher_part, _row_dot(ps, g)], g


def _distill_chunk(h, w, b, th, tw, tb, labels, vocab_start: int, softcaps, options: DistillOptions, group, grads):
    """([CE sum, divergence sum], gradient of alpha CE + (1 - alpha) divergence w.r.t. the chunk's student logits in
    ``w``'s dtype, or None without ``grads``) of one chunk; ``group``: the vocabulary-split ranks to reduce over.
    Float32, in place where it can."""
    student, capped = head_logits(h, w, b, softcaps[0])
    teacher = head_logits(th, tw, tb, softcaps[1])[0]  # its tanh (soft cap) not kept: no gradient goes through it
    temperature, alpha = options.temperature, options.alpha
    valid = labels != IGNORE_INDEX
    local = labels - vocab_start
    owned = valid & (local >= 0) & (local < student.shape[1])
    index = torch.where(owned, local, 0).unsqueeze(1)
    target = student.gather(1, index).squeeze(1) * owned
    maxima = _reduced(torch.stack([student.amax(1), teacher.amax(1)]), dist.ReduceOp.MAX, group)
    student.sub_(maxima[0].unsqueeze(1))  # s - max(s); max(s / T) = max(s) / T
    log_pt = teacher.sub_(maxima[1].unsqueeze(1)).div_(temperature)
    plain = student.exp() if grads and alpha else None  # temperature 1: the cross-entropy's softmax
    plain_sum = None if temperature == 1 else (plain if plain is not None else student.exp()).sum(1)
    log_ps = student.div_(temperature)
    ps, pt = log_ps.exp(), log_pt.exp()  # not yet normalized
    sums = [ps.sum(1), pt.sum(1)]
    sums = _reduced(torch.stack([*sums, sums[0] if plain_sum is None else plain_sum, target]), dist.ReduceOp.SUM, group)
    log_ps.sub_(sums[0].log().unsqueeze(1))
    log_pt.sub_(sums[1].log().unsqueeze(1))
    ps.div_(sums[0].unsqueeze(1))
    pt = None if options.divergence == "reverse_kl" else pt.div_(sums[1].unsqueeze(1))
    parts, g = _divergence_parts(log_ps, log_pt, ps, pt, options)
    parts = _reduced(torch.stack(parts), dist.ReduceOp.SUM, group)
    ce = (maxima[0] + sums[2].log() - sums[3]) * valid
    statistics = torch.stack([ce.sum(), (parts.sum(0) * valid).sum()])
    if not grads:
        return statistics, None
    if options.divergence == "forward_kl":
        grad = ps.sub_(g)  # p_s - p_t
    else:  # p_s (g - sum_v p_s g)
        grad = ps.mul_(g.sub_(parts[-1].unsqueeze(1)))
    grad.mul_((1 - alpha) / temperature)
    if plain is not None:
        grad.add_(plain.div_(sums[2].unsqueeze(1)), alpha=alpha)
        grad.scatter_add_(1, index, (-alpha * owned).unsqueeze(1).to(grad.dtype))
    grad.mul_(valid.unsqueeze(1))
    if capped is not None:
        grad.mul_(capped.mul_(capped).neg_().add_(1))  # the soft-cap's derivative, 1 - tanh^2
    return statistics, grad.to(w.dtype)


@functools.cache
def _compiled_chunk():
    """``_distill_chunk`` compiled (made on first use: importing dynamo costs seconds that eager runs need not pay)."""
    return torch.compile(_distill_chunk, dynamic=False)


def _chunks(tokens: int, chunk_size: int):
    return (slice(start, start + chunk_size) for start in range(0, tokens, chunk_size))


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher, labels, chunk_size, compute_dtype, vocab_start, setting):
        softcaps, options, group, compiled = setting
        compute = compute_dtype or weight.dtype
        h, w = hidden.to(compute), weight.to(compute)
        b = bias.to(compute) if bias is not None else None
        chunk_fn = _compiled_chunk() if compiled and group is None else _distill_chunk
        grads = ChunkGradients(h, ctx.needs_input_grad[:3])
        sums = torch.zeros(2, dtype=torch.float32, device=hidden.device)
        th, tw, tb = teacher
        for part in _chunks(labels.shape[0], chunk_size):
            chunk_sums, grad_logits = chunk_fn(
                h[part], w, b, th[part], tw, tb, labels[part], vocab_start, softcaps, options, group, True
            )
            sums += chunk_sums
            grads.add(part, grad_logits, h, w)
            del grad_logits
        ctx.save_for_backward(grads.hidden, *grads.sums_or_zeros(weight, bias))
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.compute = compute
        ctx.mark_non_differentiable(sums)
        return _weighted(sums, options), sums

    @staticmethod
    def backward(ctx, grad_loss, grad_sums):
        # Not in place: zero-bubble pipeline schedules call this twice (input gradients, then weight gradients).
        # Each gradient is rounded to the compute dtype once, as the fused cross-entropy rounds its own (fused.py).
        del grad_sums  # the sums are metrics
        wanted = ctx.needs_input_grad
        scaled = [
            None if grad is None or not want else _scaled(grad, grad_loss, ctx.compute).to(dtype)
            for grad, dtype, want in zip(ctx.saved_tensors, ctx.dtypes, wanted[:3])
        ]
        return (*scaled, *([None] * 6))


def _teacher_slices(teacher_hidden, teacher_weight, teacher_bias, vocab_start: int, vocab_rows: int):
    """The teacher's hidden states (whole, local), its head's vocabulary slice and bias, detached, as the student's
    chunks meet them; the slice must be the student's (the same rows of the same vocabulary)."""
    teacher_hidden = _replicated(teacher_hidden, teacher_weight).flatten(0, 1)
    th, tw, tb, _, teacher_start = vocabulary_slices(teacher_hidden, teacher_weight, teacher_bias)
    if teacher_start != vocab_start or tw.shape[0] != vocab_rows:
        raise ValueError(
            f"the teacher's head holds vocabulary rows {teacher_start}..{teacher_start + tw.shape[0]} here, the "
            f"student's {vocab_start}..{vocab_start + vocab_rows}: both heads must be split over the same vocabulary"
        )
    return th.detach(), tw.detach(), tb.detach() if tb is not None else None


def _fused(hidden, teacher_hidden, labels, weight, bias, teacher_weight, teacher_bias, options, settings):
    compute_dtype, chunk_size, softcaps, compiled = settings
    hidden, weight, bias, group, vocab_start = vocabulary_slices(hidden, weight, bias)
    th, tw, tb = _teacher_slices(teacher_hidden, teacher_weight, teacher_bias, vocab_start, weight.shape[0])
    teacher_compute = compute_dtype or tw.dtype
    teacher = (th.to(teacher_compute), tw.to(teacher_compute), tb.to(teacher_compute) if tb is not None else None)
    chunk_size = chunk_size if chunk_size > 0 else max(labels.shape[0], 1)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        setting = (softcaps, options, group, compiled)
        return _FusedDistill.apply(
            hidden, weight, bias, teacher, labels, chunk_size, compute_dtype, vocab_start, setting
        )
    compute = compute_dtype or weight.dtype
    h, w = hidden.to(compute), weight.to(compute)
    b = bias.to(compute) if bias is not None else None
    chunk_fn = _compiled_chunk() if compiled and group is None else _distill_chunk
    sums = torch.zeros(2, dtype=torch.float32, device=hidden.device)
    for part in _chunks(labels.shape[0], chunk_size):
        chunk = (h[part], w, b, teacher[0][part], *teacher[1:], labels[part])
        sums += chunk_fn(*chunk, vocab_start, softcaps, options, group, False)[0]
    return _weighted(sums, options), sums


def _weighted(sums: torch.Tensor, options: DistillOptions) -> torch.Tensor:
    """The loss from its [CE sum, divergence sum]."""
    return options.alpha * sums[0] + (1 - options.alpha) * sums[1]


def _whole_logits(hidden, weight, bias, compute: torch.dtype, softcap) -> torch.Tensor:
    """Float32 soft-capped logits of all tokens, gathered whole under tensor parallelism."""
    logits = F.linear(hidden.to(compute), weight.to(compute), bias.to(compute) if bias is not None else None)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logits = logits.float()
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def token_divergences(student_logits, teacher_logits, options: DistillOptions) -> torch.Tensor:
    """Each token's divergence (its vocabulary sum) from whole float32 logits (tokens, vocab), as TRL defines it."""
    log_ps = F.log_softmax(student_logits / options.temperature, dim=-1)
    log_pt = F.log_softmax(teacher_logits / options.temperature, dim=-1)
    if options.divergence == "forward_kl":
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if options.divergence == "reverse_kl":
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    beta = options.beta
    mixture = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    return (beta * log_pt.exp() * (log_pt - mixture) + (1 - beta) * log_ps.exp() * (log_ps - mixture)).sum(-1)


def _unfused(hidden, teacher_hidden, labels, weight, bias, teacher_weight, teacher_bias, options, settings):
    compute_dtype, _, softcaps, _ = settings
    valid = labels != IGNORE_INDEX
    student = _whole_logits(hidden, weight, bias, compute_dtype or weight.dtype, softcaps[0])[valid]
    with torch.no_grad():
        teacher_hidden = _replicated(teacher_hidden, teacher_weight).flatten(0, 1)
        teacher_dtype = compute_dtype or teacher_weight.dtype
        teacher = _whole_logits(teacher_hidden, teacher_weight, teacher_bias, teacher_dtype, softcaps[1])[valid]
    sums = torch.stack(
        [F.cross_entropy(student, labels[valid], reduction="sum"), token_divergences(student, teacher, options).sum()]
    )
    return _weighted(sums, options), sums.detach()


def distill_loss_sum(
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    options: DistillOptions,
    *,
    compute_dtype: torch.dtype | None = None,
    chunk_size: int = 0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, sums): loss = sum over labelled tokens (labels != -100) of alpha*CE + (1-alpha)*divergence, a float32
    scalar differentiable w.r.t. hidden, weight, bias (the student's); sums = detached float32 (2,) tensor
    [CE sum, divergence sum] over the same tokens (for metrics).

    ``hidden`` (B, S, H) and ``teacher_hidden`` (B, S, Ht): the final hidden states (possibly sequence-parallel
    DTensors); ``labels`` (B, S), already shifted; ``weight`` (V, H), possibly vocabulary-sharded, and
    ``teacher_weight`` (V, Ht) sharded alike. ``compute_dtype``: both heads compute in it (otherwise each in its
    weight's dtype); ``chunk_size``: tokens per fused chunk (0: whole logits and autograd); ``softcap`` /
    ``teacher_softcap``: each model's final logit soft-capping; ``compiled``: compile the fused chunk. The teacher
    never gets gradients; without autograd only the forward is computed.
    """
    hidden = _replicated(hidden, weight).flatten(0, 1)
    labels = labels.flatten()
    settings = (compute_dtype, chunk_size, (softcap, teacher_softcap), compiled)
    path = _fused if chunk_size > 0 else _unfused
    return path(hidden, teacher_hidden, labels, weight, bias, teacher_weight, teacher_bias, options, settings)
