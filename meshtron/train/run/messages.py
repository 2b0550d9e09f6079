"""The log lines of a run: what it trains (first line), and what it did (last line)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.command import meshtron_command
from meshtron.config import reference_kind
from meshtron.data.chat import ChatDataset
from meshtron.data.preference import PreferenceDataset
from meshtron.data.streaming import StreamingDataset
from meshtron.distributed.torchrun_env import local_world_size
from meshtron.models.moe import is_moe, num_experts
from meshtron.train.moe.router_balance import resolve_router_balance
from meshtron.train.moe.router_loss import router_loss_enabled


def evaluated_message(result) -> str:
    """The last line of meshtron eval (``result``: its TrainResult)."""
    step, loss = result.eval_losses[-1]
    preference = getattr(result, "eval_preference", {})
    if preference:  # a preference objective's loss has no perplexity: its pairs ranked right instead
        figure = f"rewards/accuracies {preference['rewards/accuracies']:.4f}"
    else:
        figure = f"perplexity {math.exp(min(loss, 700)):.2f}"
    return (
        f"meshtron: evaluated the model after step {step}: evaluation loss {loss:.4f}, {figure}; outputs in "
        f"{result.output_dir}/ (config.toml, metrics.jsonl)"
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
    """The first log line: family, parameters, layout, precision, what is computed (settings_summary), data and its
    tokenizer, how a step splits the batch and when the run evaluates. ``built``: the trainer's built model (model,
    adapter, pipeline group); ``policy``: its PrecisionPolicy; ``evaluator``: its Evaluator or None;
    ``evaluates_once``: meshtron eval."""
    batch = setup.batch
    if setup.dims.pp > 1:
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
        f"meshtron: {built.adapter.family} model, {counted} | {settings_summary(cfg, setup, policy)} | "
        f"{data_summary(dataset, cfg.data.seq_len)} | "
        f"tokenizer: {setup.tokenizer.describe()} | {batching}"
        + (f" | {evaluator.describe(once=evaluates_once)}" if evaluator is not None else "")
    )


def settings_summary(cfg, setup, policy) -> str:
    """What the start-up line says is on: the layout, the precision, then what is computed and where it lives
    (``setup``: the RunSetup, its resolved degrees, compile and attention kernel; ``policy``: the PrecisionPolicy)."""
    return (
        f"layout: {layout_summary(cfg, setup.dims)} | {precision_summary(cfg, policy)} | {computed_summary(cfg, setup)}"
    )


def layout_summary(cfg, dims) -> str:
    """The degrees, and how the parallelisms that have variants run: the cp method, TP without sequence or loss
    parallel, FSDP's unsharded accumulation, model state in host memory."""
    p, notes = cfg.parallel, []
    if dims.cp > 1:
        if p.cp_method == "hybrid":
            notes.append(f"hybrid: ulysses {p.cp_ulysses} x ring {dims.cp // p.cp_ulysses}")
        else:
            notes.append(p.cp_method)
    if dims.tp > 1:
        notes += [
            f"no {name.replace('_', ' ')}" for name in ("sequence_parallel", "loss_parallel") if not getattr(p, name)
        ]
    if cfg.fsdp.accumulate_unsharded:
        notes.append("gradients unsharded between micro-batches")
    described = dims.describe() + (f" ({', '.join(notes)})" if notes else "")
    return described + host_state_note(cfg)


def host_state_note(cfg) -> str:
    """What ``fsdp.cpu_offload`` adds to the layout's description."""
    if not cfg.fsdp.cpu_offload:
        return ""
    return ", parameters, gradients and optimizer state in host memory (fsdp.cpu_offload)"


def precision_summary(cfg, policy) -> str:
    """The weights' dtype and the compute's (``policy``: the run's PrecisionPolicy), fp16's loss scaling, the
    gradients' reduction dtype under mixed precision, float8 matmuls."""
    parts = [f"{cfg.model.dtype} weights", policy.describe()]
    if policy.loss_scaling:
        parts[-1] += " with loss scaling"
    if policy.compute_dtype is not None:
        reduce = cfg.fsdp.reduce_dtype or f"{policy.name} (the compute dtype)"
        parts.append(f"gradients reduced in {reduce}")
    if cfg.precision.float8:
        parts.append(f"float8 {cfg.precision.float8_recipe} matmuls")
    return ", ".join(parts)


def _preference_summary(cfg) -> str:
    """A preference objective, its main settings and its reference: ``DPO (beta 0.1, sigmoid), reference: a frozen
    copy of the starting weights``."""
    objective = cfg.train.objective
    if objective == "dpo":
        d = cfg.dpo
        settings = f"beta {d.beta:g}, {d.loss_type}"
        settings += f", label smoothing {d.label_smoothing:g}" if d.label_smoothing else ""
        settings += f", rpo_alpha {d.rpo_alpha:g}" if d.rpo_alpha else ""
    elif objective == "simpo":
        settings = f"beta {cfg.simpo.beta:g}, gamma {cfg.simpo.gamma:g}"
        settings += f", cpo_alpha {cfg.simpo.cpo_alpha:g}" if cfg.simpo.cpo_alpha else ""
    else:  # ipo, orpo
        settings = f"beta {getattr(cfg, objective).beta:g}"
    kind = reference_kind(cfg)
    reference = {
        "model": "a frozen copy of the starting weights"
        + (f" in {cfg.preference.reference_dtype}" if cfg.preference.reference_dtype else ""),
        "lora_base": "the base model (LoRA adapters off)",
        "precomputed": "precomputed log-probabilities",
        "none": "none",
    }[kind]
    return f"{objective.upper()} ({settings}), reference: {reference}"


def _distill_summary(cfg, setup) -> str:
    """``distill from <teacher> (<layers> layers, hidden <h>, <dtype>; forward_kl, T 1, alpha 0)``."""
    d = cfg.distill
    if setup.teacher_config is None:
        return f"distill from {d.teacher}"
    shape = setup.teacher_config
    divergence = d.divergence + (f" beta {d.beta:g}" if d.divergence == "jsd" else "")
    return (
        f"distill from {d.teacher} ({shape.num_hidden_layers} layers, hidden {shape.hidden_size}, "
        f"{setup.teacher_model.dtype}; {divergence}, temperature {d.temperature:g}, alpha {d.alpha:g})"
    )


def computed_summary(cfg, setup) -> str:
    """The objective and every setting that changes what a step computes or where its tensors live, briefly."""
    d, t = cfg.data, cfg.train
    if t.objective == "causal_lm":
        objective = "causal LM"
    elif t.objective == "distill":
        objective = _distill_summary(cfg, setup)
    else:
        objective = _preference_summary(cfg)
    if d.format == "chat":
        objective += ", chat: loss on " + ("the assistant's tokens" if d.train_on == "assistant" else "all tokens")
    parts = [objective]
    if not d.mask_documents:
        parts.append("no document masks")
    elif setup.dims.cp == 1:  # under cp the context-parallel exchange computes them
        parts.append(f"document masks ({setup.attention_kernel})")
    else:
        parts.append("document masks")
    parts += _model_notes(cfg) + _moe_notes(cfg, setup.hf_config) + _optimization_notes(cfg)
    if t.activation_checkpointing != "none":
        parts.append(f"activation checkpointing {t.activation_checkpointing}")
    if setup.compiled:
        parts.append("compiled blocks")
    if t.mlp_tiles > 1:
        parts.append(f"MLP in {t.mlp_tiles} tiles")
    if t.activation_offload:
        parts.append("activations offloaded to host memory")
    if t.loss_chunk_size == 0:
        parts.append("logits whole (train.loss_chunk_size=0)")
    return ", ".join(parts)


def _model_notes(cfg) -> list[str]:
    """Rope scaling, positions, LoRA."""
    m, lora, notes = cfg.model, cfg.lora, []
    if m.rope_scaling:
        kind = m.rope_scaling.get("rope_type", m.rope_scaling.get("type", "rope"))
        factor = m.rope_scaling.get("factor")
        notes.append(f"rope scaling {kind}" + (f" x{factor:g}" if isinstance(factor, (int, float)) else ""))
    if m.max_position_embeddings is not None:
        notes.append(f"{m.max_position_embeddings:,} positions")
    if lora.enabled:
        on = ",".join(lora.targets) if lora.targets else "every projection"
        extra = "".join(f" + {name}" for name in ("embeddings", "head") if getattr(lora, f"train_{name}"))
        dropout = f", dropout {lora.dropout:g}" if lora.dropout else ""
        notes.append(f"LoRA rank {lora.rank} alpha {lora.alpha:g} on {on}{extra}{dropout}")
    return notes


def _moe_notes(cfg, hf_config) -> list[str]:
    """A mixture of experts' experts and how its routers are balanced (``moe.router_balance`` resolved)."""
    if not is_moe(hf_config):
        return []
    if resolve_router_balance(cfg.moe.router_balance, hf_config) == "bias":
        balance = "router bias balancing"
    else:
        balance = (
            "router aux loss" if router_loss_enabled(cfg.moe.router_aux_loss, hf_config) else "no router balancing"
        )
    return [f"{num_experts(hf_config)} experts, {balance}"]


def _optimization_notes(cfg) -> list[str]:
    """The optimizer when not AdamW, the batch's changes over the run."""
    notes = []
    if cfg.optimizer.name != "adamw":
        notes.append(f"{cfg.optimizer.name} optimizer")
    if cfg.train.batch_rampup.strip():
        notes.append(f"batch rampup {cfg.train.batch_rampup.strip()}")
    if cfg.data.skip_batches:
        notes.append(f"{len(cfg.data.skip_batches)} global batches skipped")
    return notes


def data_summary(dataset, seq_len: int) -> str:
    if isinstance(dataset, (StreamingDataset, ChatDataset, PreferenceDataset)):
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
