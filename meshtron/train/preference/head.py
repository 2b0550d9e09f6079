"""The preference loss of a micro-batch on the head: per-token log-probabilities (the chunked head, vocabulary-
parallel under tensor parallelism: no rank holds a ``tokens x vocab`` tensor), summed per answer, summed over the
context-parallel ranks, and turned into the objective's loss and metric sums (meshtron.train.loss.preference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.train.loss.preference import PreferenceObjective, prompt_sums, sequence_sums
from meshtron.train.loss.token_logps import head_token_logps
from meshtron.train.preference.targets import PairCounts, unpack_targets


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank of the group computes the same loss from the summed
    values, and each rank's share of the sum takes the gradient of its own copy of that loss (so that the
    gradients of the shares add up to the loss's gradient once, as the context-parallel ranks' token losses do)."""

    @staticmethod
    def forward(ctx, tensor, group):
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed over ``group`` (None: itself), with the gradient of ``_SumOverGroup``."""
    if group is None:
        return tensor
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _SumOverGroup.apply(tensor, group)
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total


@dataclass(frozen=True)
class HeadOptions:
    """How the head computes (as meshtron.train.loss.head.head_loss_sum takes them)."""

    compute_dtype: torch.dtype | None = None
    chunk_size: int = 0
    loss_parallel: bool = False
    softcap: float | None = None
    compiled: bool = False


def answer_logps(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    runs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    head: HeadOptions,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (B, 2) summed log-probabilities of the chosen and rejected answers and their (B, 2) token counts,
    whole over the context-parallel ranks (``cp_group``)."""
    sums, lengths, _ = pair_logps(hidden, labels, runs, weight, bias, head, cp_group)
    return sums, lengths


def pair_logps(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    runs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    head: HeadOptions,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``answer_logps``'s sums and counts and, per row (B,), the summed log-probabilities of the chosen prompt's
    NLL-only targets (ORPO's; zeros without them), all whole over the context-parallel ranks in one all-reduce."""
    token_logps = head_token_logps(
        hidden,
        labels,
        weight,
        bias,
        compute_dtype=head.compute_dtype,
        chunk_size=head.chunk_size,
        loss_parallel=head.loss_parallel,
        softcap=head.softcap,
        compiled=head.compiled,
    )
    sums, lengths = sequence_sums(token_logps.view(labels.shape), runs)
    # (B, 5): the answers' sums, the prompt's, the answers' counts (no gradient), in one all-reduce over cp.
    both = sum_over_group(torch.cat([sums, prompt_sums(token_logps, runs)[:, None], lengths], dim=1), cp_group)
    return both[:, :2], both[:, 3:], both[:, 2]


@dataclass(frozen=True)
class PreferenceHead:
    """The preference loss of micro-batches: the objective, the head's options, the context-parallel group."""

    objective: PreferenceObjective
    head: HeadOptions
    cp_group: dist.ProcessGroup | None = None
    cp: int = 1

    def loss(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        counts: PairCounts,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the loss to back-propagate, this rank's share of the reported loss, this rank's share of the metric
        sums) of one micro-batch whose ``target`` is a ``pack_targets`` tensor. Every context-parallel rank
        computes the whole loss (its answers' sums are all-reduced), so each reports a ``1 / cp`` share."""
        labels, runs, reference = unpack_targets(target)
        sums, lengths, prompts = pair_logps(hidden, labels, runs, weight, bias, self.head, self.cp_group)
        loss, metrics = self.objective.loss(
            sums,
            lengths,
            reference if self.objective.uses_reference else None,
            global_pairs=counts.pairs,
            global_chosen_tokens=counts.chosen_tokens,
            nll_logps=sums[:, 0] + prompts,
        )
        return loss, loss.detach() / self.cp, metrics.detach() / self.cp
