"""The training loop: build, parallelize and materialize the model, then step through the global batches.

Loss is the sum of token losses over the whole global batch divided by the global number of target
tokens, so it is the same number whatever the layout, micro-batch size or accumulation.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.checkpoint.manager import CheckpointManager, checkpoint_directory, checkpoint_meta, resume_point
from meshtron.checkpoint.state import TrainingState
from meshtron.config import Config, save_config, to_toml
from meshtron.data.dataset import PackedDataset, build_packed_dataset
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.sources import check_data_path
from meshtron.data.tokenizer import load_tokenizer
from meshtron.distributed.context_parallel import check_context_parallel
from meshtron.distributed.data_parallel import set_gradient_sync
from meshtron.distributed.grad_norm import clip_gradients, global_grad_norm
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.parallelize import parallelize
from meshtron.distributed.tensor_parallel import (
    check_tensor_parallel,
    local_value,
    loss_context,
    reduce_partial_gradients,
)
from meshtron.errors import ConfigError, MeshtronError
from meshtron.metrics.activations import SavedActivationTracker
from meshtron.metrics.flops import device_peak_flops, flops_per_token
from meshtron.metrics.logger import MetricsLogger, max_memory_gb, model_state_bytes
from meshtron.models.adapter import adapter_for
from meshtron.models.attention import check_attention
from meshtron.models.build import build_meta_model, check_model_path, load_hf_config, materialize
from meshtron.distributed.pipeline_parallel import check_pipeline
from meshtron.train.batch import IGNORE_INDEX, SequenceSplit, sequence_inputs, shard_labels, token_loss_sum
from meshtron.train.pipeline_runner import build_pipeline_runner
from meshtron.train.optim import build_optimizer, build_scheduler
from meshtron.train.runtime import Runtime

RUN_MARKERS = ("config.toml", "metrics.jsonl")


@dataclass
class Plan:
    """Everything checked before any collective: resolved degrees, batch split, tokenizer and model config."""

    dims: ParallelDims
    micro_batch_size: int
    accumulation_steps: int
    tokenizer: object
    hf_config: object
    pp_microbatches: int = 1
    """With pipeline parallelism: microbatches each data-parallel rank's batch is split into."""
    resume_from: Path | None = None
    """The checkpoint this run continues from."""


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    output_dir: Path | None = None
    model: nn.Module | None = None
    """The model; under pipeline parallelism an ``nn.ModuleList`` of this rank's stages (see model_parts)."""
    model_parts: list[nn.Module] = field(default_factory=list)
    """The Hugging Face model (or, under pipeline parallelism, this rank's stages of it), parameter names unchanged."""
    optimizer: torch.optim.Optimizer | None = None
    start_step: int = 0
    """Optimizer steps already done when this run started (from a checkpoint)."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """This rank's parameter, gradient and optimizer-state bytes, measured after the first optimizer step."""
    activation_bytes: int = 0
    """This rank's peak bytes kept by autograd for backward, measured in the second step (the first one
    also holds torch.distributed.pipelining's set-up forward); see meshtron.metrics.activations."""


def micro_batch_plan(cfg: Config, dims: ParallelDims) -> tuple[int, int]:
    """(micro_batch_size, accumulation_steps) per rank, or a ConfigError if the batch does not split."""
    batch, dp = cfg.train.global_batch_size, dims.dp
    if dims.pp > 1 and batch % dp == 0:  # the pipeline schedule splits the rank's batch itself
        return batch // dp, 1
    micro = cfg.train.micro_batch_size or max(1, batch // dp)
    if batch % (dp * micro):
        raise ConfigError(
            f"train.global_batch_size {batch} is not divisible by data-parallel degree {dp} x "
            f"train.micro_batch_size {micro} = {dp * micro}; make the global batch a multiple of {dp * micro}"
        )
    return micro, batch // (dp * micro)


def check_output_dir(output_dir: str | None, resuming: bool = False) -> None:
    """Refuse to write into a directory that already holds a run's outputs, unless continuing that run."""
    if output_dir is None or resuming:
        return
    path = Path(output_dir)
    if any((path / marker).exists() for marker in RUN_MARKERS):
        raise ConfigError(f"run.output_dir '{path}' already holds a run; choose a new run.output_dir")


def preflight(cfg: Config, world_size: int, device_type: str) -> Plan:
    """All checks that need no process group, run identically on every rank (and by the launcher)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    micro, accumulation = micro_batch_plan(cfg, dims)
    if cfg.fsdp.cpu_offload and device_type != "cuda":
        raise ConfigError("fsdp.cpu_offload needs CUDA devices; set fsdp.cpu_offload=false on CPU")
    check_model_path(cfg.model)
    check_data_path(cfg.data.path)
    tokenizer = load_tokenizer(cfg.data.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if max_positions is not None and cfg.data.seq_len > max_positions:
        raise ConfigError(
            f"data.seq_len {cfg.data.seq_len} is larger than the model's max_position_embeddings {max_positions}; "
            f"use data.seq_len <= {max_positions}"
        )
    check_context_parallel(dims.cp, cfg.data.seq_len)
    check_attention(
        hf_config, cfg.model.attn_implementation, dims.cp, cfg.data.mask_documents, cfg.data.seq_len, dims.pp
    )
    pp_microbatches = check_pipeline(cfg.parallel, hf_config, micro, cfg.train.micro_batch_size is not None)
    check_tensor_parallel(
        hf_config, adapter_for(hf_config), dims.tp, cfg.data.seq_len, cfg.parallel.sequence_parallel, dims.cp
    )
    resume_from = resume_point(cfg, hf_config)
    check_output_dir(cfg.run.output_dir, resuming=resume_from is not None)
    return Plan(dims, micro, accumulation, tokenizer, hf_config, pp_microbatches, resume_from)


def _resolve_output_dir(cfg: Config, runtime: Runtime) -> Path:
    """The run's output directory, chosen by rank 0 and shared with the others."""
    chosen = [cfg.run.output_dir]
    if runtime.is_main and chosen[0] is None:
        chosen[0] = str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)
    cfg.run.output_dir = chosen[0]
    return Path(chosen[0])


def _dp_coordinates(meshes: dict | None, dims: ParallelDims) -> tuple[int, object | None]:
    """This rank's index among the data-parallel ranks and the group that sums losses over them
    (the data-parallel and context-parallel ranks: together they hold every token of the global batch)."""
    if meshes is None or dims.dp * dims.cp == 1:
        return 0, None
    dp_rank = meshes["dp"].get_local_rank() if dims.dp > 1 else 0
    return dp_rank, meshes["dp_cp"].get_group()


def _sequence_split(meshes: dict | None, dims: ParallelDims, cfg: Config, eos_token_id: int | None) -> SequenceSplit:
    cp_rank, cp_group = 0, None
    if dims.cp > 1:
        cp_mesh = meshes["world"]["cp"]
        cp_rank, cp_group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    return SequenceSplit(
        dims.cp, cp_rank, cp_group, cfg.parallel.cp_method, cfg.data.mask_documents, eos_token_id, dims.pp
    )


def _all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def train(cfg: Config, runtime: Runtime, plan: Plan | None = None) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps; rank 0 writes metrics and the resolved config."""
    plan = plan or preflight(cfg, runtime.world_size, runtime.device.type)
    dims = plan.dims
    output_dir = _resolve_output_dir(cfg, runtime)
    runtime.barrier()  # every rank has run its checks on the output directory before rank 0 writes into it
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        if not (plan.resume_from and (output_dir / "config.toml").exists()):  # a resumed run keeps its record
            save_config(cfg, output_dir / "config.toml")

    torch.manual_seed(cfg.train.seed)
    dataset = build_packed_dataset(
        cfg.data, plan.tokenizer, is_builder=runtime.local_rank == 0, barrier=runtime.barrier
    )
    schedule = GlobalBatchSchedule(len(dataset), cfg.train.global_batch_size, cfg.data.shuffle, cfg.data.seed)

    meshes = dims.build_mesh(runtime.device.type) if runtime.distributed else None
    split = _sequence_split(meshes, dims, cfg, plan.tokenizer.eos_token_id)
    model, adapter = build_meta_model(plan.hf_config, cfg.model)
    stages = parallelize(model, adapter, dims, meshes, cfg)
    for _, stage in stages:
        materialize(stage, adapter, runtime.device, seed=cfg.train.seed, pretrained_dir=cfg.model.name_or_path)
        stage.train()
    parts = [stage for _, stage in stages]
    runner = None
    if dims.pp > 1:
        model, runner = build_pipeline_runner(stages, adapter, cfg, plan, dims, meshes, runtime.device, split)
    else:
        model = parts[0]
    pp_group = meshes["world"]["pp"].get_group() if dims.pp > 1 else None

    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    dp_rank, loss_group = _dp_coordinates(meshes, dims)
    step_context = _StepContext(dp_rank, dims, plan, loss_group, split, runtime.device, cfg, runner, pp_group)
    logger = MetricsLogger(output_dir, cfg.train.steps, enabled=runtime.is_main, progress=cfg.run.progress)
    logger.message(
        f"meshtron: {adapter.family} model, {_count_params(model, pp_group):,} parameters | layout: {dims.describe()} | {len(dataset):,} sequences of {cfg.data.seq_len} tokens | "
        + (f"{plan.micro_batch_size} sequences per rank in {plan.pp_microbatches} pipeline microbatches "
           f"({cfg.parallel.pp_schedule})" if dims.pp > 1 else
           f"micro-batch {plan.micro_batch_size} x {plan.accumulation_steps} accumulation")
    )
    peak = device_peak_flops(runtime.device)
    flops_tok = flops_per_token(plan.hf_config, cfg.data.seq_len)
    result = TrainResult(output_dir=output_dir, model=model, model_parts=parts, optimizer=optimizer)
    state = TrainingState(parts, model, optimizer)
    checkpoints = None
    if cfg.checkpoint.interval > 0 or plan.resume_from:
        checkpoints = CheckpointManager(
            checkpoint_directory(cfg), cfg.checkpoint.interval, cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
            runtime,
        )
    start_step = 0
    if plan.resume_from:
        meta = checkpoints.load(plan.resume_from, state)
        start_step = meta["step"]
        scheduler.load_state_dict(meta["scheduler"])
        logger.message(f"meshtron: resumed from {plan.resume_from} (step {start_step}, saved as {meta['layout']})")
    result.start_step = start_step
    activation_step = min(start_step + 1, cfg.train.steps - 1)
    try:
        for step in range(start_step, cfg.train.steps):
            started = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            loss, grad_norm, tokens = _train_step(
                model, optimizer, dataset, schedule, step, step_context,
                measure_state=result if step == start_step else None,
                measure_activations=result if step == activation_step else None,
            )
            scheduler.step()
            if runtime.device.type == "cuda":
                torch.cuda.synchronize(runtime.device)
            seconds = time.perf_counter() - started
            tokens_per_s = tokens / seconds
            result.losses.append(loss)
            result.grad_norms.append(grad_norm)
            result.tokens_per_s.append(tokens_per_s)
            if step == activation_step:
                logger.message(
                    f"meshtron: step {step + 1}: autograd kept {result.activation_bytes / 1e9:.3f} GB of activations "
                    f"for backward at its peak on rank 0 (meshtron plan estimates this; see docs/planning.md)"
                )
            if (step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.train.steps:
                logger.log(
                    {
                        "step": step + 1,
                        "loss": loss,
                        "grad_norm": grad_norm,
                        "lr": lr,
                        "tokens_per_s": tokens_per_s,
                        "mfu": flops_tok * tokens_per_s / (peak * runtime.world_size) if peak else None,
                        "max_memory_gb": max_memory_gb(runtime.device),
                    }
                )
            if checkpoints is not None and checkpoints.due(step + 1, cfg.train.steps):
                meta = checkpoint_meta(step + 1, scheduler, plan.hf_config, cfg, runtime, dims.describe())
                checkpoints.save(step + 1, state, meta, to_toml(cfg))
        if checkpoints is not None:
            checkpoints.wait()
        trained = f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else "nothing left to train"
        logger.message(
            f"meshtron: done, {cfg.train.steps} steps, {trained}; outputs in {output_dir}/ (config.toml, metrics.jsonl)"
        )
    finally:
        logger.close()
    return result


def _count_params(model: nn.Module, pp_group=None) -> int:
    """Parameters of the whole model (DTensors counted at full size, pipeline stages summed)."""
    from torch.distributed.tensor import DTensor

    count = sum(p.numel() if not isinstance(p, DTensor) else math.prod(p.shape) for p in model.parameters())
    if pp_group is None:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=next(model.parameters()).device)
    return int(_all_reduce_sum(total, pp_group).item())


@dataclass
class _StepContext:
    """What every step needs besides the model, optimizer and data."""

    dp_rank: int
    dims: ParallelDims
    plan: Plan
    loss_group: object
    split: SequenceSplit
    device: torch.device
    cfg: Config
    runner: object = None
    pp_group: object = None


def _forward_backward(model, batches, split: SequenceSplit, scale: float, device) -> torch.Tensor:
    """Forward and backward of each micro-batch (gradient accumulation); returns the summed token loss.

    ``batches``: (full token ids, this rank's labels) per micro-batch.
    """
    local_loss_sum = torch.zeros((), device=device)
    for index, (input_ids, labels) in enumerate(batches):
        set_gradient_sync(model, index == len(batches) - 1)
        logits = model(**sequence_inputs(input_ids, split)).logits
        with loss_context(logits):  # vocab-sharded logits under loss parallel: forward and backward inside
            loss_sum = token_loss_sum(logits, labels)
            (loss_sum * scale).backward()
        local_loss_sum += local_value(loss_sum.detach())
        del logits, loss_sum
    return local_loss_sum


def _train_step(
    model, optimizer, dataset: PackedDataset, schedule, step, ctx: _StepContext, measure_state=None, measure_activations=None
):
    """One optimizer step over this rank's micro-batches; returns (global loss, global grad norm, global tokens).

    ``measure_state`` / ``measure_activations``: a TrainResult whose ``state_bytes`` / ``activation_bytes``
    this step measures.
    """
    dims, device, cfg = ctx.dims, ctx.device, ctx.cfg
    micro_batches = schedule.local_micro_batches(step, ctx.dp_rank, dims.dp, ctx.plan.micro_batch_size)
    batches = [(input_ids.to(device), shard_labels(labels.to(device), ctx.split))
               for input_ids, labels in map(dataset.batch, micro_batches)]
    targets = torch.tensor(float(sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)), device=device)
    global_targets = _all_reduce_sum(targets, ctx.loss_group).clamp(min=1.0)
    # FSDP averages gradients over the dp x cp ranks; scaling by dp x cp turns that mean into the sum.
    scale = dims.dp * dims.cp / global_targets.item()
    tracker = SavedActivationTracker() if measure_activations is not None else None
    with tracker.track() if tracker is not None else contextlib.nullcontext():
        if ctx.runner is not None:  # the pipeline schedule splits the batch into microbatches itself
            (input_ids, labels), = batches
            local_loss_sum = ctx.runner.run(input_ids, labels, scale)
        else:
            local_loss_sum = _forward_backward(model, batches, ctx.split, scale, device)
    parameters = [p for p in model.parameters() if p.grad is not None]
    if not dims.fsdp_enabled:  # FSDP sums partial tensor-parallel gradients itself
        reduce_partial_gradients(parameters)
    grad_norm = global_grad_norm(parameters, pipeline_degree=dims.pp)
    # Summed over the dp x cp ranks, then over the pipeline ranks (only the last stage has a loss).
    loss = _all_reduce_sum(_all_reduce_sum(local_loss_sum, ctx.loss_group), ctx.pp_group) / global_targets
    loss_value, norm_value = loss.item(), grad_norm.item()
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        if cfg.train.on_nonfinite == "error":
            raise MeshtronError(
                f"step {step + 1}: loss is {loss_value} and gradient norm is {norm_value}; training diverged. "
                "Lower train.lr, raise train.warmup_steps, check the data, or set train.on_nonfinite=skip"
            )
        optimizer.zero_grad(set_to_none=True)
        return loss_value, norm_value, float(global_targets)
    clip_gradients(parameters, cfg.train.max_grad_norm, grad_norm)
    optimizer.step()
    if measure_state is not None:
        measure_state.state_bytes = model_state_bytes(model, optimizer)
    if measure_activations is not None:
        measure_activations.activation_bytes = tracker.peak_bytes
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm_value, float(global_targets)
