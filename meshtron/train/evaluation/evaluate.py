"""Validation: the model's loss on sequences it does not train on, the same number under every layout.

The evaluation data (``eval.path``, or the documents ``eval.holdout_documents`` keeps out of training) is read in
order, ``eval.batches`` global batches of ``train.global_batch_size`` sequences, the same ones at every evaluation.
Each global batch is cut over the data-parallel ranks and micro-batches exactly as a training step's is
(meshtron.train.step.step_sequences), so the forward passes are those of training, without backward: the loss is
the sum of every token loss over all the batches divided by their labelled tokens, which is what one process
computes. Evaluation runs in eval mode (no dropout, no router jitter) under ``torch.no_grad``, reads no training
data and draws no random numbers, so a run's training losses are the same with evaluation on or off.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.config import EvalConfig, TrainConfig
from meshtron.data.prefetch import StepReader
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.distributed.data_parallel import reshard_all
from meshtron.distributed.precision import release_compute_weights
from meshtron.tensors import local_tensor
from meshtron.train.batch import sequence_inputs, shard_labels
from meshtron.train.pipeline.evaluate import pipeline_eval_loss_sum, pipeline_forward
from meshtron.train.preference.targets import PairCounts
from meshtron.train.step import (
    StepContext,
    device_batches,
    distill_loss,
    model_head_loss,
    pair_counts,
    preference_loss,
    step_sequences,
    teacher_targets,
    with_reference_logps,
)
from meshtron.train.step_stats import global_loss_sum, global_target_count, host_values


@dataclass(frozen=True)
class Evaluation:
    loss: float
    """Summed token loss over the evaluated batches / their labelled tokens (the router loss not included)."""
    tokens: int
    batches: int
    preference: dict[str, float] = field(default_factory=dict)
    """A preference objective's metrics (TRL's names: ``rewards/accuracies`` ...), means over the evaluated pairs;
    empty for causal LM."""
    distill: dict[str, float] = field(default_factory=dict)
    """``train.objective=distill``: the held-out cross-entropy (``nll_loss``) and divergence, means over the
    evaluated tokens (``loss`` is the objective's: their ``alpha`` mix); empty otherwise."""

    @property
    def perplexity(self) -> float:
        """exp of the held-out cross-entropy (a distillation's ``nll_loss``, not its mixed loss)."""
        loss = self.distill.get("nll_loss", self.loss)
        return math.exp(loss) if loss < 700 else math.inf

    def metrics(self) -> dict:
        """The fields of the step's metrics row (a preference objective's loss has no perplexity: its metrics
        instead, as TRL names them on evaluation: ``eval_rewards/accuracies`` ...)."""
        if self.preference:
            named = {f"eval_{name}": value for name, value in self.preference.items()}
            return {"eval_loss": self.loss, **named, "eval_tokens": self.tokens}
        named = {f"eval_{name}": value for name, value in self.distill.items()}
        return {"eval_loss": self.loss, **named, "eval_perplexity": self.perplexity, "eval_tokens": self.tokens}


class Evaluator:
    """``evaluate(model)`` on this rank (every rank calls it together); ``due(step)``: whether a step evaluates."""

    def __init__(self, dataset, ctx: StepContext, interval: int, batches: int, *, global_batch: int, last_step: int):
        self.ctx = ctx
        self.interval, self.global_batch, self.last_step = interval, global_batch, last_step
        self.batches = min(batches, len(dataset) // global_batch)
        self.order = GlobalBatchSchedule(len(dataset), global_batch, shuffle=False, seed=0)
        self.reader = StepReader(
            dataset,
            lambda batch: step_sequences(self.order, batch, ctx),
            global_target_count,
            prefetch=False,
            pin=ctx.device.type == "cuda",
            count_pairs=pair_counts if ctx.preference is not None else None,
            references=ctx.precomputed_reference,
        )

    def due(self, step: int) -> bool:
        """After ``step`` steps: every ``eval.interval`` steps and after the last one."""
        return step == self.last_step or (self.interval > 0 and step % self.interval == 0)

    def describe(self, once: bool = False) -> str:
        """``once``: the run only evaluates (meshtron eval)."""
        when = (
            ""
            if once
            else f"every {self.interval} steps and after the last step "
            if self.interval
            else "after the last step "
        )
        return f"evaluating {when}on {self.batches} batches of {self.global_batch} sequences"

    @torch.no_grad()
    def evaluate(self, model) -> Evaluation:
        if self.ctx.preference is not None:
            return self._evaluate_preference(model)
        if self.ctx.distill is not None:
            return self._evaluate_distill(model)
        ctx = self.ctx
        parts = ctx.runner.modules if ctx.runner is not None else [model]
        local = torch.zeros((), device=ctx.device)
        targets = 0
        with eval_mode(parts):
            for batch in range(self.batches):
                inputs = self.reader.get(batch)
                targets += inputs.global_targets
                for input_ids, labels in inputs.micro_batches:
                    input_ids = input_ids.to(ctx.device, non_blocking=True)
                    labels = shard_labels(labels.to(ctx.device, non_blocking=True), ctx.split)
                    local += self._loss_sum(model, input_ids, labels)
        release_compute_weights(*parts)
        reshard_all(*parts)  # as training's backward would have: the next step must find them as usual
        (loss,) = host_values(global_loss_sum(local, targets, loss_copies=ctx.dims.tp))
        return Evaluation(loss, targets, self.batches)

    def _loss_sum(self, model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx.runner is not None:
            return pipeline_eval_loss_sum(ctx.runner, input_ids, labels)
        hidden = model(**sequence_inputs(input_ids, ctx.split))
        with loss_parallel() if ctx.loss_parallel else contextlib.nullcontext():
            return local_tensor(model_head_loss(model, hidden, labels, ctx))

    def _evaluate_preference(self, model) -> Evaluation:
        """A preference objective's loss and metrics over the evaluated pairs, normalized by all of them at once
        (their counts are read first), each micro-batch's reference and policy forward only."""
        ctx, preference = self.ctx, self.ctx.preference
        parts = ctx.runner.modules if ctx.runner is not None else [model]
        # The counts from the batches' indices alone: each batch is read (and pinned) only when it is evaluated.
        batch_counts = [
            pair_counts(self.reader.dataset, step_sequences(self.order, batch, ctx).global_batch)
            for batch in range(self.batches)
        ]
        counts = PairCounts(sum(c.pairs for c in batch_counts), sum(c.chosen_tokens for c in batch_counts))
        local = torch.zeros((), device=ctx.device)
        metric_sums = torch.zeros(len(preference.objective.metric_names), device=ctx.device)
        tokens = 0
        with eval_mode(parts):
            for batch in range(self.batches):
                step = self.reader.get(batch)
                tokens += step.global_targets
                references = step.references or [None] * len(step.micro_batches)
                for (input_ids, labels), reference in zip(step.micro_batches, references):
                    on_device = device_batches(
                        [(input_ids, labels)], ctx, [reference] if reference is not None else None
                    )
                    ((input_ids, target, bounds),) = with_reference_logps(on_device, ctx)
                    share, metrics = self._preference_sums(model, input_ids, target, bounds, counts)
                    local += share
                    metric_sums += metrics
        release_compute_weights(*parts)
        reshard_all(*parts)
        totals = global_loss_sum(torch.cat([local.reshape(1), metric_sums]), 1, loss_copies=ctx.dims.tp)
        loss, *values = host_values(*totals)
        named = preference.objective.metric_values(torch.tensor(values), counts.pairs)
        return Evaluation(loss, tokens, self.batches, named)

    def _preference_sums(self, model, input_ids, target, bounds, counts: PairCounts):
        """(this rank's share of the loss, of the metric sums) of one micro-batch (the last pipeline stage's)."""
        ctx, preference = self.ctx, self.ctx.preference
        zero = (
            torch.zeros((), device=ctx.device),
            torch.zeros(len(preference.objective.metric_names), device=ctx.device),
        )
        if ctx.runner is None:
            hidden = model(**sequence_inputs(input_ids, ctx.split, bounds))
            with loss_parallel() if ctx.loss_parallel else contextlib.nullcontext():
                _, share, metrics = preference_loss(model, hidden, target, ctx, counts)
            return local_tensor(share), metrics
        runner = ctx.runner
        parts = target.tensor_split(runner.microbatches) if runner.holds_last else None
        found = [zero]

        def on_last_stage(hidden, micro):
            weight, bias = runner.head()
            _, share, metrics = preference.loss(hidden, parts[micro], weight, bias, counts)
            found.append((local_tensor(share), metrics))

        pipeline_forward(runner, input_ids, on_last_stage)
        return sum(share for share, _ in found), sum(metrics for _, metrics in found)

    def _evaluate_distill(self, model) -> Evaluation:
        """A distillation's held-out loss, cross-entropy and divergence, means over the evaluated tokens, the
        teacher's and the student's forwards only."""
        ctx = self.ctx
        parts = ctx.runner.modules if ctx.runner is not None else [model]
        local = torch.zeros(3, device=ctx.device)  # the loss, the cross-entropy, the divergence
        targets = 0
        with eval_mode(parts):
            for batch in range(self.batches):
                inputs = self.reader.get(batch)
                targets += inputs.global_targets
                for input_ids, labels, bounds in device_batches(inputs.micro_batches, ctx):
                    local += self._distill_sums(model, input_ids, labels, bounds)
        release_compute_weights(*parts)
        reshard_all(*parts)
        loss, nll, divergence = host_values(*global_loss_sum(local, targets, loss_copies=ctx.dims.tp))
        return Evaluation(loss, targets, self.batches, distill={"nll_loss": nll, "divergence": divergence})

    def _distill_sums(self, model, input_ids, labels, bounds) -> torch.Tensor:
        """(3,) this rank's summed loss, cross-entropy and divergence of one micro-batch (the last pipeline
        stage's; zeros on the other stages)."""
        ctx, distill = self.ctx, self.ctx.distill
        target = teacher_targets(input_ids, labels, bounds, ctx)
        if ctx.runner is None:
            hidden = model(**sequence_inputs(input_ids, ctx.split, bounds))
            with loss_parallel() if ctx.loss_parallel else contextlib.nullcontext():
                loss, sums = distill_loss(model, hidden, target, ctx)
            return torch.cat([local_tensor(loss).reshape(1), sums])
        runner = ctx.runner
        parts = target.tensor_split(runner.microbatches) if runner.holds_last else None
        found = [torch.zeros(3, device=ctx.device)]

        def on_last_stage(hidden, micro):
            loss, sums = distill.loss(hidden, parts[micro], *runner.head())
            found.append(torch.cat([local_tensor(loss).reshape(1), sums]))

        pipeline_forward(runner, input_ids, on_last_stage)
        distill.teacher.release()
        return sum(found)

    def close(self) -> None:
        self.reader.close()


def build_evaluator(dataset, ctx: StepContext, evaluation: EvalConfig, train: TrainConfig) -> Evaluator | None:
    """The run's Evaluator (``evaluation``, ``train``: the ``[eval]`` and ``[train]`` settings), or None without
    evaluation data."""
    if dataset is None:
        return None
    return Evaluator(
        dataset,
        ctx,
        evaluation.interval,
        evaluation.batches,
        global_batch=train.global_batch_size,
        last_step=train.steps,
    )


@contextlib.contextmanager
def eval_mode(modules):
    """The modules in eval mode, then back in the mode each was in."""
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, modes):
            module.train(mode)
