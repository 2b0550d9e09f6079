"""The preference objectives (DPO, IPO, SimPO, ORPO) as TRL 1.16 computes them, from per-answer sums to losses.

A preference row holds one pair (the row contract of ``data.format=preference``): the chosen sequence, a separator,
the rejected sequence, a separator, padding; its labels are set only on the two answers' tokens, so they form two
runs of labelled positions. ``preference_runs`` numbers them (0 chosen, 1 rejected, -1 no label; 2 the chosen
prompt's targets that only ORPO's NLL counts, marked below IGNORE_INDEX: ``target_tokens`` turns them back into
tokens), ``sequence_sums`` adds each answer's per-token log-probabilities (meshtron.train.loss.token_logps) and
tokens, ``prompt_sums`` the chosen prompts', and a
``PreferenceObjective`` turns the sums into this micro-batch's share of the global loss and the metric sums.

TRL averages over its batch (pairs, or the batch's chosen tokens for the NLL terms); here each average is a sum over
this micro-batch divided by the global count (``global_pairs``, ``global_chosen_tokens``), so that the shares of all
micro-batches and ranks add up to TRL's value on one process without accumulation, whatever the micro-batching.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtron.config import DpoConfig, IpoConfig, OrpoConfig, SimpoConfig
from meshtron.data.labels import IGNORE_INDEX, NLL_ONLY_LABELS_BELOW

REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


PROMPT_RUN = 2
"""The run of the chosen prompt's targets that only the NLL term counts (ORPO's; meshtron.data.labels)."""


def nll_covers_prompt(objective: str) -> bool:
    """Whether ``train.objective``'s NLL term covers the chosen sequence's prompt tokens as well as its answer's
    (ORPO: TRL's ORPOTrainer takes it "over the full prompt and response"), so its data labels them."""
    return objective == "orpo"


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with the NLL-only marks (meshtron.data.labels.NLL_ONLY_LABELS_BELOW) turned back into their tokens."""
    return torch.where(labels < NLL_ONLY_LABELS_BELOW, NLL_ONLY_LABELS_BELOW - 1 - labels, labels)


def preference_runs(labels: torch.Tensor) -> torch.Tensor:
    """Each position's run of labels (B, S): 0 in the chosen answer's, 1 in the rejected answer's, -1 unlabelled,
    ``PROMPT_RUN`` where the label marks a chosen prompt's target for the NLL term only.

    ``labels``: a micro-batch's whole rows (before any context-parallel cut). A row whose answers' labelled positions
    do not form exactly two runs is not a preference row: ValueError.
    """
    labelled = labels > IGNORE_INDEX
    before = torch.zeros_like(labelled[:, :1])
    starts = labelled & ~torch.cat([before, labelled[:, :-1]], dim=1)
    counts = starts.sum(1)
    if bool((counts != 2).any()):
        row = int(torch.nonzero(counts != 2)[0, 0])
        raise ValueError(
            f"row {row} of the micro-batch has {int(counts[row])} runs of labelled positions; a preference row holds "
            "exactly two (the chosen answer's, then the rejected answer's)"
        )
    runs = starts.cumsum(1) - 1
    return torch.where(labelled, runs, torch.where(labels < NLL_ONLY_LABELS_BELOW, PROMPT_RUN, -1))


def sequence_sums(token_logps: torch.Tensor, runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the summed log-probabilities (B, 2) and token counts (B, 2, float32) of the chosen (column 0) and
    rejected (column 1) answers over this rank's positions; ``token_logps``: (B, S) or flattened, as ``runs``."""
    logps = token_logps.reshape(runs.shape)
    answers = [runs == run for run in (0, 1)]
    sums = torch.stack([torch.where(answer, logps, 0).sum(1) for answer in answers], dim=1)
    counts = torch.stack([answer.sum(1) for answer in answers], dim=1).to(torch.float32)
    return sums, counts


def prompt_sums(token_logps: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """Per row (B,) the summed log-probabilities of the chosen prompt's NLL-only targets (``PROMPT_RUN``; zeros
    without them) over this rank's positions."""
    logps = token_logps.reshape(runs.shape)
    return torch.where(runs == PROMPT_RUN, logps, 0).sum(1)


@dataclass(frozen=True)
class PairTerms:
    """One micro-batch's pairs under an objective: each pair's loss (B,), the rewards TRL logs (B, 2), the
    log-probabilities TRL logs (B, 2: sums or averages) and the objective's extra per-pair metrics (B, k)."""

    losses: torch.Tensor
    rewards: torch.Tensor
    logps: torch.Tensor
    extra: torch.Tensor | None = None


def _averages(policy: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return policy / lengths


def _dpo_terms(cfg: DpoConfig) -> Callable:
    def terms(policy, lengths, reference):
        logratios = policy - reference
        delta = cfg.beta * (logratios[:, 0] - logratios[:, 1])
        if cfg.loss_type == "robust":
            eps = cfg.label_smoothing
            losses = (-(1 - eps) * F.logsigmoid(delta) + eps * F.logsigmoid(-delta)) / (1 - 2 * eps)
        else:
            losses = -F.logsigmoid(delta)
        return PairTerms(losses, cfg.beta * logratios.detach(), policy.detach())

    return terms


def _ipo_terms(cfg: IpoConfig) -> Callable:
    """TRL divides by the answer's tokens in the inputs, ``lengths`` counts its labels: the same but for an answer
    with no prompt before it (whose first token is no label)."""

    def terms(policy, lengths, reference):
        logratios = policy - reference
        average = logratios / lengths.clamp(min=1.0)
        losses = (average[:, 0] - average[:, 1] - 1 / (2 * cfg.beta)) ** 2
        return PairTerms(losses, cfg.beta * logratios.detach(), policy.detach())

    return terms


def _simpo_terms(cfg: SimpoConfig) -> Callable:
    def terms(policy, lengths, reference):
        average = _averages(policy, lengths)
        losses = -F.logsigmoid(cfg.beta * (average[:, 0] - average[:, 1] - cfg.gamma / cfg.beta))
        return PairTerms(losses, cfg.beta * average.detach(), average.detach())

    return terms


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branching at -ln 2 as TRL's ORPO does (no cancellation on either side)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo_terms(cfg: OrpoConfig) -> Callable:
    def terms(policy, lengths, reference):
        average = _averages(policy, lengths)
        log_odds = (average[:, 0] - average[:, 1]) - (_log1mexp(average[:, 0]) - _log1mexp(average[:, 1]))
        ratio = F.logsigmoid(log_odds)
        extra = torch.stack([ratio, log_odds], dim=1).detach()
        return PairTerms(-cfg.beta * ratio, cfg.beta * average.detach(), average.detach(), extra)

    return terms


@dataclass(frozen=True)
class PreferenceObjective:
    """A preference objective: whether it needs a reference model, the metrics it logs (TRL's names), and ``loss``.

    Metrics: all but ``nll_loss`` are per pair (their sums over pairs, to divide by the global pair count);
    ``nll_loss`` is already this micro-batch's share of the global batch's value (see ``metric_values``).
    """

    name: str
    uses_reference: bool
    metric_names: tuple[str, ...]
    pair_terms: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], PairTerms]
    nll_weight: float = 0.0
    """Weight of the chosen answers' NLL in the loss: DPO's rpo_alpha, SimPO's cpo_alpha, 1 for ORPO."""

    @property
    def per_pair_metrics(self) -> tuple[bool, ...]:
        """For each metric: whether ``loss``'s metric vector holds its sum over pairs (else the share of its value)."""
        return tuple(name != "nll_loss" for name in self.metric_names)

    def loss(
        self,
        policy: torch.Tensor,
        lengths: torch.Tensor,
        reference: torch.Tensor | None,
        *,
        global_pairs: int,
        global_chosen_tokens: int,
        nll_logps: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This micro-batch's share of the global loss (a differentiable scalar) and its metric sums.

        ``policy``, ``reference``: each pair's summed log-probabilities (B, 2: chosen, rejected), whole over
        context-parallel shards; ``lengths``: the answers' token counts (B, 2). The loss is the sum over this
        micro-batch's pairs of the pair loss divided by ``global_pairs``, plus ``nll_weight`` x the NLL term: minus
        the summed log-probability of the chosen answers' tokens over ``global_chosen_tokens``, which equals TRL's
        mean over the batch's chosen tokens once every share is added. ``nll_logps``: the summed log-probabilities
        the NLL covers, when they are not the chosen answers' (ORPO: TRL's covers the chosen prompt's tokens too;
        ``global_chosen_tokens`` then counts those tokens); default ``policy[:, 0]``.
        """
        if self.uses_reference and reference is None:
            raise ValueError(f"train.objective={self.name} compares with a reference model: pass its log-probabilities")
        terms = self.pair_terms(policy, lengths, reference)
        loss = terms.losses.sum() / global_pairs
        logs_nll = "nll_loss" in self.metric_names
        if self.nll_weight or logs_nll:
            nll_share = -(policy[:, 0] if nll_logps is None else nll_logps).sum() / global_chosen_tokens
        if self.nll_weight:
            loss = loss + self.nll_weight * nll_share
        rewards = terms.rewards
        metrics = [
            rewards[:, 0],
            rewards[:, 1],
            (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
            rewards[:, 0] - rewards[:, 1],
            terms.logps[:, 0],
            terms.logps[:, 1],
        ]
        sums = [metric.sum() for metric in metrics]
        if logs_nll:  # TRL's CPO logs 0 when its cpo_alpha is 0 (it does not compute the NLL then)
            sums.append(nll_share.detach() if self.nll_weight else torch.zeros_like(nll_share))
        if terms.extra is not None:
            sums.extend(terms.extra.sum(0).unbind())
        return loss, torch.stack(sums)

    def metric_values(self, totals: torch.Tensor, global_pairs: int) -> dict[str, float]:
        """The global batch's metrics from the metric vectors of ``loss`` summed over all micro-batches and ranks."""
        return {
            name: float(total) / (global_pairs if per_pair else 1)
            for name, total, per_pair in zip(self.metric_names, totals.tolist(), self.per_pair_metrics)
        }


def preference_objective(
    objective: str, dpo: DpoConfig, ipo: IpoConfig, simpo: SimpoConfig, orpo: OrpoConfig
) -> PreferenceObjective | None:
    """``train.objective``'s preference objective from its section; None for ``causal_lm`` and ``distill``."""
    if objective == "dpo":
        return PreferenceObjective("dpo", True, REWARD_METRICS, _dpo_terms(dpo), dpo.rpo_alpha)
    if objective == "ipo":
        return PreferenceObjective("ipo", True, REWARD_METRICS, _ipo_terms(ipo))
    if objective == "simpo":
        return PreferenceObjective("simpo", False, (*REWARD_METRICS, "nll_loss"), _simpo_terms(simpo), simpo.cpo_alpha)
    if objective == "orpo":
        metrics = (*REWARD_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
        return PreferenceObjective("orpo", False, metrics, _orpo_terms(orpo), 1.0)
    if objective in ("causal_lm", "distill"):
        return None
    raise ValueError(f"unknown train.objective {objective!r}")
