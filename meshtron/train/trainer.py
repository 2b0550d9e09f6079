"""The training loop: build, parallelize and materialize the model, then step through the global batches
(each step is meshtron.train.step.train_step)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.checkpoint.manager import (
    CheckpointManager, check_fixed_directory, checkpoint_directory, checkpoint_meta, resume_point,
)
from meshtron.checkpoint.state import TrainingState
from meshtron.config import Config, save_config, to_toml
from meshtron.data.dataset import build_packed_dataset
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.sources import check_data_path
from meshtron.data.tokenizer import load_tokenizer
from meshtron.distributed.context_parallel import check_context_parallel
from meshtron.distributed.expert_parallel import check_expert_parallel
from meshtron.distributed.data_parallel import check_data_parallel, parameter_device
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.parallelize import parallelize
from meshtron.distributed.tensor_parallel import check_tensor_parallel
from meshtron.distributed.tied_embeddings import attach_tied_embedding_sync
from meshtron.errors import ConfigError
from meshtron.metrics.flops import device_peak_flops, flops_per_token
from meshtron.metrics.logger import MetricsLogger, max_memory_gb
from meshtron.models.adapter import adapter_for
from meshtron.models.attention import attention_windows, check_attention
from meshtron.models.families import check_family
from meshtron.models.moe import moe_layer_indices
from meshtron.models.build import build_meta_model, check_model_path, load_hf_config, materialize
from meshtron.distributed.pipeline_parallel import check_pipeline
from meshtron.train.batch import SequenceSplit
from meshtron.train.float8 import check_float8, refresh_float8_scales
from meshtron.train.pipeline_runner import build_pipeline_runner
from meshtron.train.optim import build_optimizer, build_scheduler
from meshtron.train.precision import PrecisionPolicy, loss_scaler, precision_policy
from meshtron.train.faults import fault_from_env
from meshtron.train.restart import last_logged_step, restart_count, restart_message
from meshtron.train.router_loss import build_router_loss
from meshtron.train.runtime import Runtime, launched_by_torchrun
from meshtron.train.step import StepContext, train_step

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
    precision: PrecisionPolicy | None = None
    resume_skipped: tuple[str, ...] = ()
    """Newer checkpoints ``checkpoint.resume=auto`` passed over as damaged, one line each."""


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
    accumulation_grad_bytes: int = 0
    """This rank's peak gradient bytes between the micro-batches of a gradient accumulation (first step;
    0 without accumulation or under pipeline parallelism); see meshtron.metrics.gradient_memory."""
    activation_bytes: int = 0
    """This rank's peak bytes kept by autograd for backward, measured in the second step (the first one
    also holds torch.distributed.pipelining's set-up forward); see meshtron.metrics.activations."""


def micro_batch_plan(cfg: Config, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per forward, accumulation_steps) per rank, or a ConfigError if the batch does not split.

    Under pipeline parallelism the forward is the schedule's step over the rank's whole batch, which it
    splits into microbatches of ``train.micro_batch_size`` (see check_pipeline), without accumulation.
    """
    batch, dp = cfg.train.global_batch_size, dims.dp
    micro = cfg.train.micro_batch_size or max(1, batch // dp)
    if batch % (dp * micro):
        raise ConfigError(
            f"train.global_batch_size {batch} is not divisible by data-parallel degree {dp} x "
            f"train.micro_batch_size {micro} = {dp * micro}; make the global batch a multiple of {dp * micro}"
        )
    if dims.pp > 1:
        return batch // dp, 1
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
    check_data_parallel(cfg.fsdp, dims)
    precision = precision_policy(cfg, device_type)
    check_float8(cfg, device_type)
    check_model_path(cfg.model)
    check_data_path(cfg.data.path)
    tokenizer = load_tokenizer(cfg.data.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    check_family(hf_config, tp=dims.tp, attn_implementation=cfg.model.attn_implementation)
    check_expert_parallel(hf_config, dims.ep)
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
    pp_microbatches = check_pipeline(cfg.parallel, hf_config, micro, cfg.train.micro_batch_size, device_type)
    check_tensor_parallel(
        hf_config, adapter_for(hf_config), dims.tp, cfg.data.seq_len, cfg.parallel.sequence_parallel, dims.cp
    )
    check_fixed_directory(cfg, launched=launched_by_torchrun())
    skipped: list[str] = []
    resume_from = resume_point(cfg, hf_config, skipped)
    # A restart by torchrun continues this run in its own output directory, with or without a checkpoint.
    check_output_dir(cfg.run.output_dir, resuming=resume_from is not None or restart_count() > 0)
    return Plan(dims, micro, accumulation, tokenizer, hf_config, pp_microbatches, resume_from, precision, tuple(skipped))


def _resolve_output_dir(cfg: Config, runtime: Runtime) -> tuple[Path, str]:
    """The run's output directory and an id of this start of the run, both chosen by rank 0 and shared."""
    chosen = [cfg.run.output_dir, uuid.uuid4().hex]
    if runtime.is_main and chosen[0] is None:
        chosen[0] = str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)
    cfg.run.output_dir = chosen[0]
    return Path(chosen[0]), chosen[1]


def _dp_rank(meshes: dict | None, dims: ParallelDims) -> int:
    """This rank's index among the data-parallel ranks (which slice of the global batch it trains on)."""
    return meshes["dp"].get_local_rank() if meshes is not None and dims.dp > 1 else 0


def _sequence_split(meshes: dict | None, dims: ParallelDims, cfg: Config, eos_token_id: int | None,
                    hf_config) -> SequenceSplit:
    cp_rank, cp_group = 0, None
    if dims.cp > 1:
        cp_mesh = meshes["world"]["cp"]
        cp_rank, cp_group = cp_mesh.get_local_rank(), cp_mesh.get_group()
    return SequenceSplit(
        dims.cp, cp_rank, cp_group, cfg.parallel.cp_method, cfg.data.mask_documents, eos_token_id, dims.pp,
        attention_windows(hf_config),
    )


def train(cfg: Config, runtime: Runtime, plan: Plan | None = None) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps; rank 0 writes metrics and the resolved config."""
    plan = plan or preflight(cfg, runtime.world_size, runtime.device.type)
    dims = plan.dims
    output_dir, run_id = _resolve_output_dir(cfg, runtime)
    runtime.barrier()  # every rank has run its checks on the output directory before rank 0 writes into it
    checkpoints = None
    if cfg.checkpoint.interval > 0 or plan.resume_from:  # first: checks that every rank shares the directory
        checkpoints = CheckpointManager(
            checkpoint_directory(cfg), cfg.checkpoint.interval, cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
            runtime,
        )
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        if not (plan.resume_from and (output_dir / "config.toml").exists()):  # a resumed run keeps its record
            save_config(cfg, output_dir / "config.toml")

    torch.manual_seed(cfg.train.seed)
    dataset = build_packed_dataset(  # the others wait for local rank 0's build outside any collective
        cfg.data, plan.tokenizer, is_builder=runtime.local_rank == 0, run_id=run_id
    )
    schedule = GlobalBatchSchedule(len(dataset), cfg.train.global_batch_size, cfg.data.shuffle, cfg.data.seed)

    meshes = dims.build_mesh(runtime.device.type) if runtime.distributed else None
    split = _sequence_split(meshes, dims, cfg, plan.tokenizer.eos_token_id, plan.hf_config)
    model, adapter = build_meta_model(plan.hf_config, cfg.model)
    if dims.pp == 1:
        adapter.return_hidden_states(model)  # the loss applies the head (pipeline stages do the same)
    policy = plan.precision or precision_policy(cfg, runtime.device.type)
    moe_layers = moe_layer_indices(model)  # before the pipeline split: the whole model's
    stages = parallelize(model, adapter, dims, meshes, cfg, runtime.device.type)
    for _, stage in stages:
        materialize(
            stage, adapter, parameter_device(cfg.fsdp, runtime.device), seed=cfg.train.seed,
            pretrained_dir=cfg.model.name_or_path, buffer_device=runtime.device,
        )
        stage.train()
    parts = [stage for _, stage in stages]
    runner = None
    if dims.pp > 1:
        model, runner = build_pipeline_runner(
            stages, adapter, cfg, plan, dims, meshes, runtime.device, split, policy.compute_dtype, moe_layers
        )
        # Tied embeddings: the last stage's head copy gets the first stage's gradient added after backward.
        attach_tied_embedding_sync(runner, parts, [stage_id for stage_id, _ in stages], cfg.parallel, meshes)
    else:
        model = parts[0]
    pp_group = meshes["world"]["pp"].get_group() if dims.pp > 1 else None

    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    step_context = StepContext(
        _dp_rank(meshes, dims), dims, plan, split, runtime.device, cfg, runner, adapter, policy,
        loss_scaler(policy, cfg), router=build_router_loss(model, plan.hf_config, cfg, dims, meshes),
    )
    restarts = restart_count()  # > 0: torchrun restarted the workers after a failure (meshtron.train.restart)
    logged_before = last_logged_step(output_dir) if restarts and runtime.is_main else 0
    logger = MetricsLogger(output_dir, cfg.train.steps, enabled=runtime.is_main, progress=cfg.run.progress)
    logger.message(
        f"meshtron: {adapter.family} model, {_count_params(model, pp_group):,} parameters | layout: {dims.describe()} | "
        f"{policy.describe()} | {len(dataset):,} sequences of {cfg.data.seq_len} tokens | "
        + (f"{plan.micro_batch_size} sequences per rank in {plan.pp_microbatches} pipeline microbatches of "
           f"{plan.micro_batch_size // plan.pp_microbatches} ({cfg.parallel.pp_schedule})" if dims.pp > 1 else
           f"micro-batch {plan.micro_batch_size} x {plan.accumulation_steps} accumulation")
    )
    peak = device_peak_flops(runtime.device)
    flops_tok = flops_per_token(plan.hf_config, cfg.data.seq_len)
    result = TrainResult(output_dir=output_dir, model=model, model_parts=parts, optimizer=optimizer)
    state = TrainingState(parts, model, optimizer)
    start_step = 0
    if plan.resume_from:
        meta = checkpoints.load(plan.resume_from, state)
        start_step = meta["step"]
        scheduler.load_state_dict(meta["scheduler"])
        if step_context.scaler is not None and "loss_scaler" in meta:
            step_context.scaler.load_state_dict(meta["loss_scaler"])
        for line in plan.resume_skipped:
            logger.message(f"meshtron: {line}; skipped it")
        logger.message(f"meshtron: resumed from {plan.resume_from} (step {start_step}, saved as {meta['layout']})")
    result.start_step = start_step
    if restarts:
        logger.message(restart_message(restarts, plan.resume_from, start_step, logged_before))
    fault = fault_from_env()  # tests only (meshtron.train.faults); None in a normal run
    if cfg.train.float8:
        refresh_float8_scales(parts)  # FSDP's float8 all-gather: weight scales from the initial weights
    activation_step = min(start_step + 1, cfg.train.steps - 1)
    try:
        for step in range(start_step, cfg.train.steps):
            if fault is not None:
                fault.before_step(step + 1, runtime.rank)
            started = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            loss, grad_norm, tokens = train_step(
                model, optimizer, dataset, schedule, step, step_context,
                measure_state=result if not result.state_bytes else None,  # the first step that updates
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
                        **({"loss_scale": step_context.scaler.scale} if step_context.scaler is not None else {}),
                        **step_context.step_metrics,
                        **({"restart": restarts} if restarts else {}),
                    }
                )
            if checkpoints is not None and checkpoints.due(step + 1, cfg.train.steps):
                meta = checkpoint_meta(step + 1, scheduler, plan.hf_config, cfg, runtime, dims.describe())
                if step_context.scaler is not None:
                    meta["loss_scaler"] = step_context.scaler.state_dict()
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

    from meshtron.distributed.grad_norm import DUPLICATE_GRADIENT

    count = sum(p.numel() if not isinstance(p, DTensor) else math.prod(p.shape) for p in model.parameters()
                if not getattr(p, DUPLICATE_GRADIENT, False))  # a tied head copy is the embeddings again
    if pp_group is None:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=next(model.parameters()).device)
    dist.all_reduce(total, group=pp_group)
    return int(total.item())
