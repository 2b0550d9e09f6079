"""The log lines of a run: what it trains (first line), and what it did (last line)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.command import meshtron_command
from meshtron.data.chat import ChatDataset
from meshtron.data.streaming import StreamingDataset
from meshtron.distributed.runtime import local_world_size


def evaluated_message(result) -> str:
    """The last line of meshtron eval (``result``: its TrainResult)."""
    step, loss = result.eval_losses[-1]
    return (
        f"meshtron: evaluated the model after step {step}: evaluation loss {loss:.4f}, perplexity "
        f"{math.exp(min(loss, 700)):.2f}; outputs in {result.output_dir}/ (config.toml, metrics.jsonl)"
    )


def done_message(cfg, result, latest: tuple[int, Path] | None = None, runtime=None) -> str:
    """The last lines of a training run (``result``: its TrainResult): the steps this start trained, the loss, the
    outputs and the newest checkpoint (``latest``: its step and folder), then the commands that plot the run, train
    on from the checkpoint and export it. ``runtime``: the run's Runtime (None: one process)."""
    last, start = cfg.train.steps, result.start_step
    if last <= start:
        trained = f"nothing left to train (resumed after step {start} of train.steps={last})"
    else:
        trained = f"{last - start} step{'s' if last - start > 1 else ''}"
        if start:
            trained += f" ({start + 1}-{last})" if last - start > 1 else f" ({last})"
        if result.losses:
            trained += f", loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
    output_dir = result.output_dir
    command = meshtron_command()
    commands = [("see the curves", f"{command} plot {shlex.quote(str(output_dir))}")]
    checkpoint = ""
    if runtime is None or not runtime.rehearsal:  # a rehearsal saves nothing, by design
        checkpoint, more = checkpoint_hint(cfg, output_dir, latest, runtime)
        checkpoint, commands = f"; {checkpoint}", commands + more
    width = max(len(label) for label, _ in commands) + 2
    return "\n".join(
        [f"meshtron: done, {trained}; outputs in {output_dir}/ (config.toml, metrics.jsonl){checkpoint}"]
        + [f"  {label + ':':<{width}}{line}" for label, line in commands]
    )


def checkpoint_hint(cfg, output_dir: Path, latest: tuple[int, Path] | None, runtime=None) -> tuple[str, list]:
    """What the done line says of the run's newest checkpoint (``latest``: its step and folder, None when the run saved
    none), and the commands (label, command) that train on from it (twice the steps) and export it."""
    if latest is None:
        return "no checkpoint saved (checkpoint.interval=N saves one every N steps and after the last)", []
    step, path = latest
    if step < cfg.train.steps:
        return f"latest checkpoint {path}, of step {step} (checkpoint.interval=0 saved none after it)", []
    command, quoted = meshtron_command(), shlex.quote(str(path))
    resume = f"--checkpoint.resume={quoted} --train.steps={2 * cfg.train.steps}"
    world, local = (runtime.world_size, local_world_size(runtime.world_size)) if runtime is not None else (1, 1)
    if world > local:  # several machines: the same launch on each, resuming
        train_on = f"the launch command of this run with {resume}"
    else:
        nproc = f" --nproc {world}" if world > 1 else ""
        train_on = f"{command} train{nproc} --config {shlex.quote(str(Path(output_dir) / 'config.toml'))} {resume}"
    export = shlex.quote(str(Path(output_dir) / f"export-{path.name}"))
    return f"latest checkpoint {path}", [("train on", train_on), ("export it", f"{command} export {quoted} {export}")]


def saved_message(step: int, path: Path, seconds: float, paused: float | None = None) -> str:
    """The line of a complete checkpoint: its step, folder and time (``paused``: an async save's pause of
    training; its time is then until the background write was complete)."""
    took = f"{seconds:.1f}s"
    if paused is not None:
        took = f"async: complete {took} after it began, training paused {paused:.1f}s"
    return f"meshtron: saved the checkpoint of step {step} to {path} ({took})"


def startup_message(cfg, setup, built, policy, dataset, evaluator, evaluates_once: bool) -> str:
    (
        """The first log line: family, parameters, layout, precision, data and its tokenizer, how a step splits the
    batch and when the run evaluates. ``built``: the trainer's built model (model, adapter, pipeline group);
    ``evaluator``: its Evaluator or None; ``evaluates_once``: meshtron eval."""
        ""
    )
    dims, batch = setup.dims, setup.batch
    if dims.pp > 1:
        batching = (
            f"{batch.rank_batch} sequences per rank in {batch.pp_microbatches} pipeline microbatches of "
            f"{batch.micro_batch_size} ({cfg.parallel.pp_schedule})"
        )
    else:
        batching = f"micro-batch {batch.micro_batch_size} x {batch.accumulation_steps} accumulation"
    counted = f"{count_params(built.model, built.pp_group):,} parameters"
    if cfg.lora.enabled:
        counted += f" ({count_params(built.model, built.pp_group, trainable_only=True):,} trained: LoRA)"
    return (
        f"meshtron: {built.adapter.family} model, {counted} | "
        f"layout: {dims.describe()}{host_state_note(cfg)} | {policy.describe()} | "
        f"{data_summary(dataset, cfg.data.seq_len)} | "
        f"tokenizer: {setup.tokenizer.describe()} | {batching}"
        + (f" | {evaluator.describe(once=evaluates_once)}" if evaluator is not None else "")
    )


def host_state_note(cfg) -> str:
    """What ``fsdp.cpu_offload`` adds to the layout's description."""
    if not cfg.fsdp.cpu_offload:
        return ""
    return ", parameters, gradients and optimizer state in host memory (fsdp.cpu_offload)"


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
