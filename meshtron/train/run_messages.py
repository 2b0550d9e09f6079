"""The log lines of a run: what it trains (first line), and what it did (last line)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from meshtron.command import meshtron_command
from meshtron.data.chat import ChatDataset
from meshtron.data.streaming import StreamingDataset


def evaluated_message(result) -> str:
    """The last line of meshtron eval (``result``: its TrainResult)."""
    step, loss = result.eval_losses[-1]
    return (
        f"meshtron: evaluated the model after step {step}: evaluation loss {loss:.4f}, perplexity "
        f"{math.exp(min(loss, 700)):.2f}; outputs in {result.output_dir}/ (config.toml, metrics.jsonl)"
    )


def done_message(cfg, result) -> str:
    """The last line of a training run (``result``: its TrainResult)."""
    trained = f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else "nothing left to train"
    return (
        f"meshtron: done, {cfg.train.steps} steps, {trained}; outputs in {result.output_dir}/ (config.toml, "
        f"metrics.jsonl); see the curves with: {meshtron_command()} plot {result.output_dir}"
    )


def startup_message(cfg, plan, built, policy, dataset, evaluator, evaluate_only: bool) -> str:
    (
        """The first log line: family, parameters, layout, precision, data and its tokenizer, how a step splits the
    batch and when the run evaluates. ``built``: the trainer's built model (model, adapter, pipeline group);
    ``evaluator``: its Evaluator or None; ``evaluate_only``: meshtron eval."""
        ""
    )
    dims = plan.dims
    if dims.pp > 1:
        batching = (
            f"{plan.micro_batch_size} sequences per rank in {plan.pp_microbatches} pipeline microbatches of "
            f"{plan.micro_batch_size // plan.pp_microbatches} ({cfg.parallel.pp_schedule})"
        )
    else:
        batching = f"micro-batch {plan.micro_batch_size} x {plan.accumulation_steps} accumulation"
    counted = f"{count_params(built.model, built.pp_group):,} parameters"
    if cfg.lora.enabled:
        counted += f" ({count_params(built.model, built.pp_group, trainable_only=True):,} trained: LoRA)"
    return (
        f"meshtron: {built.adapter.family} model, {counted} | "
        f"layout: {dims.describe()} | {policy.describe()} | {data_summary(dataset, cfg.data.seq_len)} | "
        f"tokenizer: {plan.tokenizer.describe()} | {batching}"
        + (f" | {evaluator.describe(once=evaluate_only)}" if evaluator is not None else "")
    )


def data_summary(dataset, seq_len: int) -> str:
    if isinstance(dataset, (StreamingDataset, ChatDataset)):
        return dataset.describe()
    return f"{len(dataset):,} sequences of {seq_len} tokens"


def count_params(model: nn.Module, pp_group=None, trainable_only: bool = False) -> int:
    """Parameters of the whole model (DTensors counted at full size, pipeline stages summed); ``trainable_only``:
    those that train."""
    from torch.distributed.tensor import DTensor

    from meshtron.distributed.grad_norm import DUPLICATE_GRADIENT

    count = sum(
        p.numel() if not isinstance(p, DTensor) else math.prod(p.shape)
        for p in model.parameters()
        if not getattr(p, DUPLICATE_GRADIENT, False) and (p.requires_grad or not trainable_only)
    )  # a tied head copy is the embeddings again
    if pp_group is None:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=next(model.parameters()).device)
    dist.all_reduce(total, group=pp_group)
    return int(total.item())
