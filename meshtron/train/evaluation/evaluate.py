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
from dataclasses import dataclass

import torch
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.config import EvalConfig, TrainConfig
from meshtron.data.prefetch import StepReader
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.distributed.data_parallel import reshard_all
from meshtron.distributed.precision import release_compute_weights
from meshtron.tensors import local_tensor
from meshtron.train.batch import sequence_inputs, shard_labels
from meshtron.train.pipeline.evaluate import pipeline_eval_loss_sum
from meshtron.train.step import StepContext, model_head_loss, step_sequences
from meshtron.train.step_stats import global_loss_sum, global_target_count, host_values


@dataclass(frozen=True)
class Evaluation:
    loss: float
    """Summed token loss over the evaluated batches / their labelled tokens (the router loss not included)."""
    tokens: int
    batches: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def metrics(self) -> dict:
        """The fields of the step's metrics row."""
        return {"eval_loss": self.loss, "eval_perplexity": self.perplexity, "eval_tokens": self.tokens}


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
        ctx = self.ctx
        parts = ctx.runner.modules if ctx.runner is not None else [model]
        local = torch.zeros((), device=ctx.device)
        targets = 0
        with _eval_mode(parts):
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
def _eval_mode(modules):
    """The modules in eval mode, then back in the mode each was in."""
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, modes):
            module.train(mode)
