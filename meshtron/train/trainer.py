"""The training loop: build, parallelize and materialize the model (meshtron.train.setup.build), then step through the
global batches (each step is meshtron.train.step.train_step)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshtron.checkpoint.earlier_runs import earlier_run_notice
from meshtron.checkpoint.manager import CheckpointManager, checkpoint_directory
from meshtron.checkpoint.state import TrainingState
from meshtron.config import Config, reference_kind, to_dict
from meshtron.data.chat import ChatDataset
from meshtron.data.preference import PreferenceDataset
from meshtron.data.streaming import StreamingDataset
from meshtron.data.training_data import build_training_data
from meshtron.distributed.mesh import Meshes, ParallelDims
from meshtron.distributed.rng import seed_parallel_rng
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError
from meshtron.metrics.memory import max_memory_gb
from meshtron.metrics.profiling import StepProfiler
from meshtron.metrics.step_log import MetricsLogger
from meshtron.metrics.step_row import StepRow
from meshtron.metrics.trackers import build_trackers
from meshtron.resilience.faults import fault_plan
from meshtron.resilience.guard import RunGuard
from meshtron.train.evaluation.evaluate import Evaluator, build_evaluator
from meshtron.train.loss.preference import nll_covers_prompt
from meshtron.train.loss.scaling import loss_scaler
from meshtron.train.moe.router_balance import build_router_balance
from meshtron.train.moe.router_loss import build_router_loss
from meshtron.train.optim.build import build_optimizer, build_scheduler
from meshtron.train.preference.precomputed import attach_precomputed_reference
from meshtron.train.run.messages import done_message, startup_message
from meshtron.train.run.planned import PlannedFigures, PlannedVsMeasured
from meshtron.train.run.resumable import Resumable
from meshtron.train.run.segments import resume_run, start_segment
from meshtron.train.setup.build import (
    build_distill,
    build_model,
    build_preference_head,
    build_reference,
    sequence_split,
)
from meshtron.train.setup.preflight import agree_resume_point, preflight, verified_resume_point
from meshtron.train.setup.run_setup import RunSetup, resolved_config
from meshtron.train.step import StepContext, step_options, step_reader, train_step
from meshtron.train.step_stats import global_step_sums

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from meshtron.data.prefetch import StepReader

__all__ = ["RunSetup", "TrainResult", "preflight", "train"]  # preflight lives in meshtron.train.setup.preflight


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Wall time of each optimizer step of this start (after the device finished it)."""
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
    also holds torch.distributed.pipelining's set-up forward); see meshtron.distributed.activation_memory.measure."""
    offloaded_bytes: int = 0
    """With ``train.activation_offload``: this rank's peak bytes of activations in host memory, same step."""
    reference_bytes: int = 0
    """This rank's bytes of a ``model`` reference's parameters (``preference.reference=model``; else 0)."""
    teacher_bytes: int = 0
    """This rank's bytes of a distillation teacher's parameters (``train.objective=distill``; else 0)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    eval_preference: dict[str, float] = field(default_factory=dict)
    """A preference objective's metrics of the last evaluation (``rewards/accuracies`` ...); empty otherwise."""
    """(step, evaluation loss) of each evaluation of this start (``[eval]``; meshtron.train.evaluation.evaluate)."""

    def record(self, outcome, seconds: float) -> None:
        """Keep a finished step's figures (``outcome``: its meshtron.train.step.StepResult) and measurements."""
        self.losses.append(outcome.loss)
        self.grad_norms.append(outcome.grad_norm)
        self.tokens_per_s.append(outcome.tokens / seconds)
        self.step_seconds.append(seconds)
        if outcome.state_bytes is not None:
            self.state_bytes, self.accumulation_grad_bytes = outcome.state_bytes, outcome.accumulation_grad_bytes
        if outcome.activation_bytes is not None:
            self.activation_bytes = outcome.activation_bytes
        if outcome.offloaded_bytes is not None:
            self.offloaded_bytes = outcome.offloaded_bytes

    def rewind(self, steps_kept: int) -> None:
        """Forget the steps after the first ``steps_kept`` of this start (a rollback trains them again)."""
        del self.losses[steps_kept:], self.grad_norms[steps_kept:], self.tokens_per_s[steps_kept:]
        del self.step_seconds[steps_kept:]
        self.eval_losses = [(step, loss) for step, loss in self.eval_losses if step <= self.start_step + steps_kept]


def _resolve_output_dir(cfg: Config, runtime: Runtime) -> tuple[str, str]:
    """The run's output directory (``run.output_dir`` resolved) and an id of this start of the run, both chosen by
    rank 0 and shared."""
    chosen = [cfg.run.output_dir, uuid.uuid4().hex]
    if runtime.is_main and chosen[0] is None:
        notice = earlier_run_notice(to_dict(cfg)) if not runtime.rehearsal else None
        if notice:
            print(notice, flush=True)
        chosen[0] = str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    if runtime.distributed and not runtime.rehearsal:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0], chosen[1]


def _dp_rank(meshes: Meshes | None, dims: ParallelDims) -> int:
    """This rank's index among the data-parallel ranks (which slice of the global batch it trains on)."""
    return meshes.dp.get_local_rank() if meshes is not None and dims.dp > 1 else 0


def train(
    cfg: Config, runtime: Runtime, setup: RunSetup | None = None, *, planned: PlannedFigures | None = None
) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps; rank 0 writes metrics and the resolved config.

    ``planned``: the planner's figures for this run (meshtron.plan.for_run), which its metrics rows carry from the
    first steady step (meshtron.train.run.planned). ``meshtron eval`` is meshtron.train.evaluation.evaluate_run."""
    return run_session(cfg, runtime, setup, _train_to_end, planned=planned)


Work = Callable[[Config, Runtime, RunSetup, TrainResult, "_Loop", Resumable], str]
"""What a run does once set up, inside its guard (``train``'s steps, ``meshtron eval``'s one evaluation); the line it
ends with."""


def run_session(
    cfg: Config,
    runtime: Runtime,
    setup: RunSetup | None,
    work: Work,
    *,
    planned: PlannedFigures | None = None,
    evaluates_once: bool = False,
) -> TrainResult:
    """Set this rank's run up (data, model, optimizer, checkpoint restored, guard), do ``work``, close what it opened.
    ``evaluates_once``: the first line says the run evaluates once (``meshtron eval``), not during training."""
    faults = fault_plan()  # tests only (MESHTRON_FAULT): wraps the components it faults; empty in a normal run
    setup = setup or preflight(cfg, runtime.world_size, runtime.device.type)
    cfg = resolved_config(cfg, setup)  # the pinned model; the output directory follows (_prepare_output)
    directory = checkpoint_directory(cfg.checkpoint, cfg.run.output_dir)
    setup = faults.start_up_choice(setup, runtime.rank, directory, cfg.checkpoint.resume)
    setup = agree_resume_point(setup, runtime)  # every rank resumes rank 0's choice (one broadcast)
    setup = verified_resume_point(setup, runtime, cfg)  # its bytes as saved (checksums, each rank a share)
    if runtime.is_main and setup.tokenizer_notice:  # a pretrained model on byte ids: said before any data is built
        print(setup.tokenizer_notice, flush=True)
    if runtime.is_main and setup.revision_notice:
        print(setup.revision_notice, flush=True)
    dims = setup.dims
    cfg, run_id, checkpoints = _prepare_output(cfg, runtime, setup)
    output_dir = Path(cfg.run.output_dir)
    torch.manual_seed(cfg.train.seed)
    data = _load_data(cfg, setup, runtime, run_id)
    dataset, schedule = data.dataset, data.schedule
    meshes = dims.build_mesh(runtime.device.type) if runtime.distributed else None
    if meshes is not None:  # a seed per pipeline stage; DTensor's RNG tracker made now, with no collective
        seed_parallel_rng(meshes, cfg.train.seed)
    # Document masks cut after this token: EOS, or for chat (preference) data the token that separates conversations
    # (a pair's sequences).
    separated = isinstance(dataset, (ChatDataset, PreferenceDataset))
    separator = dataset.separator if separated else setup.tokenizer.eos_token_id
    split = sequence_split(meshes, setup, cfg, separator)
    policy = setup.precision
    built = build_model(cfg, runtime, setup, meshes, split, policy)
    preference = build_preference_head(cfg, setup, split, built)  # train.objective dpo, ipo, simpo, orpo
    reference = build_reference(cfg, runtime, setup, meshes, split, policy, built, preference)
    distill = build_distill(cfg, runtime, setup, meshes, split, policy, built)  # train.objective distill
    model = built.model
    optimizer = build_optimizer(model, cfg.optimizer, built.parts, built.adapter, policy.compute_dtype)
    scheduler = build_scheduler(optimizer, cfg)
    step_context = StepContext(
        dp_rank=_dp_rank(meshes, dims),
        setup=setup,
        split=split,
        device=runtime.device,
        options=step_options(cfg),
        adapter=built.adapter,
        runner=built.runner,
        scaler=loss_scaler(policy, cfg),
        router=build_router_loss(model, setup, cfg, meshes),
        balance=build_router_balance(built.parts, setup, cfg, meshes, runtime.device),
        preference=preference,
        reference=reference,
        distill=distill,
        precomputed_reference=reference_kind(cfg) == "precomputed",
        global_sums=faults.wrap_step_sums(global_step_sums),
    )
    logger = _metrics_logger(cfg, runtime, output_dir, dims)
    # A rehearsal (one rank on a fake process group) measures training only.
    evaluator = build_evaluator(data.eval_dataset, step_context, cfg.eval, cfg.train) if not runtime.rehearsal else None
    profiler = StepProfiler(cfg.run, output_dir, runtime.rank, runtime.device)
    logger.message(startup_message(cfg, setup, built, policy, dataset, evaluator, evaluates_once))
    if step_context.precomputed_reference:  # before the checkpoint is restored: the starting weights' log-probabilities
        datasets = (dataset, data.eval_dataset)
        attach_precomputed_reference(
            cfg, runtime, built, step_context, datasets, bool(setup.resume_from), logger.message
        )
    result = TrainResult(output_dir=output_dir, model=model, model_parts=built.parts, optimizer=optimizer)
    result.reference_bytes = reference.param_bytes() if reference is not None else 0
    result.teacher_bytes = distill.teacher.param_bytes() if distill is not None else 0
    schedule.skip(cfg.data.skip_batches)
    inputs = step_reader(
        dataset, schedule, step_context, cfg.data.prefetch
    )  # the next step's batches read while one trains
    resumable = Resumable(
        cfg=cfg,
        runtime=runtime,
        checkpoints=checkpoints,
        state=TrainingState(built.parts, model, optimizer, trained_only=cfg.lora.enabled),
        scheduler=scheduler,
        scaler=step_context.scaler,
        schedule=schedule,
        hf_config=setup.hf_config,
        layout=dims.describe(),
        parts=built.parts,
        stream=dataset if isinstance(dataset, StreamingDataset) else None,
        dataset=dataset,
        announce=logger.message,  # a line per complete save
    )
    guard = RunGuard(
        cfg.train, cfg.run, runtime, resumable, logger, result, faults
    )  # restarts, stop signals, hangs, rollback
    result.start_step = resume_run(resumable, setup, logger)  # and the warning of a learning rate that jumps
    guard.resumed(setup.resume_from, result.start_step)
    try:
        with guard:
            compared = PlannedVsMeasured(planned, result.start_step)
            loop = _Loop(step_context, inputs, scheduler, guard, logger, evaluator, profiler, compared)
            ended = work(cfg, runtime, setup, result, loop, resumable)
        logger.message(ended)
    finally:
        inputs.close()
        profiler.close()
        if evaluator is not None:
            evaluator.close()
        logger.close()
    return result


@dataclass(frozen=True)
class _Loop:
    """What the loop drives besides the model and optimizer."""

    step_context: StepContext
    inputs: StepReader
    scheduler: LRScheduler
    guard: RunGuard
    logger: MetricsLogger
    evaluator: Evaluator | None
    profiler: StepProfiler
    planned: PlannedVsMeasured


def _train_to_end(
    cfg: Config, runtime: Runtime, setup: RunSetup, result: TrainResult, loop: _Loop, resumable: Resumable
) -> str:
    """Train on from ``result.start_step`` to ``train.steps``; the run's last line."""
    step = _train_steps(cfg, runtime, setup, result, loop)
    loop.guard.finish(step)
    return done_message(cfg, result, resumable.latest, runtime)


def _load_data(cfg: Config, setup: RunSetup, runtime: Runtime, run_id: str):
    """The training and evaluation data (meshtron.data.training_data.RunData); local rank 0 builds what is missing,
    the others wait for it outside any collective."""
    return build_training_data(
        cfg.data,
        setup.tokenizer,
        cfg.train.global_batch_size,
        is_builder=runtime.local_rank == 0,
        run_id=run_id,
        evaluation=cfg.eval,
        batch_rampup=cfg.train.batch_rampup,
        preference=cfg.preference,
        prompt_nll=nll_covers_prompt(cfg.train.objective),
    )


def _metrics_logger(cfg: Config, runtime: Runtime, output_dir: Path, dims: ParallelDims) -> MetricsLogger:
    """Rank 0's metrics.jsonl, progress line and trackers."""
    return MetricsLogger(
        output_dir,
        cfg.train.steps,
        enabled=runtime.is_main,
        progress=cfg.run.progress,
        trackers=build_trackers(cfg.run, to_dict(cfg), output_dir, dims.describe()) if runtime.is_main else None,
        log_every=cfg.run.log_every,
    )


def _train_steps(cfg, runtime, setup, result: TrainResult, loop: _Loop) -> int:
    """The loop: optimizer steps from ``result.start_step`` to ``train.steps`` (a rollback goes back); the last step."""
    model, optimizer = result.model, result.optimizer
    guard, logger = loop.guard, loop.logger
    activation_step = min(result.start_step + 1, cfg.train.steps - 1)
    row = StepRow(setup.hf_config, cfg.model, cfg.lora, cfg.data.seq_len, runtime.device, runtime.world_size)
    scaler = loop.step_context.scaler  # fp16's loss scaling, else None
    step = result.start_step
    while step < cfg.train.steps:
        guard.before_step(step)
        loop.profiler.before_step(step, logger.message)
        started = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        outcome = train_step(
            model,
            optimizer,
            loop.inputs,
            step,
            loop.step_context,
            measure_state=not result.state_bytes,  # the first update
            measure_activations=step == activation_step,
            shared_flags=guard.step_flags,  # stop signals, async saves: agreed in the step's all-reduce
        )
        rolled_to = guard.rolled_back(step, outcome, lr, result.start_step)
        if rolled_to is not None:  # train.on_nonfinite=rollback: on from the last checkpoint
            step = rolled_to
            continue
        loop.scheduler.step()
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        elapsed = time.perf_counter() - started
        result.record(outcome, elapsed)
        step += 1
        if step - 1 == activation_step:
            logger.message(
                f"meshtron: step {step}: autograd kept {result.activation_bytes / 1e9:.3f} GB of activations "
                f"for backward at its peak on rank 0"
                + (f" and {result.offloaded_bytes / 1e9:.3f} GB in host memory" if cfg.train.activation_offload else "")
                + " (meshtron plan estimates this; see docs/planning.md)"
            )
        evaluation = _evaluate_if_due(loop, step, model, result)
        if loop.planned.due(step):  # once: reading the peak memory is not every step's work
            logger.message(loop.planned.message(step, max_memory_gb(runtime.device), elapsed))
        if logger.due(step) or evaluation:  # every run.log_every steps, and the first and last
            scale = scaler.scale if scaler is not None else None
            figures = row(
                step, outcome.loss, outcome.grad_norm, lr, result.tokens_per_s[-1], elapsed, scale, outcome.metrics
            )
            logger.log({**figures, **loop.planned.fields(step), **guard.metrics(), **evaluation})
        loop.profiler.after_step(step, logger.message)
        guard.after_step(step, outcome.flag_sums)  # saves when due; after a stop signal, saves and raises Preempted
    return step


def _evaluate_if_due(loop: _Loop, step: int, model, result: TrainResult) -> dict:
    """The evaluation's metrics after ``step`` steps when one is due (``eval.interval``, the last step), else {}."""
    if loop.evaluator is None or not loop.evaluator.due(step):
        return {}
    return evaluate_model(loop, step, model, result)


def evaluate_model(loop: _Loop, step: int, model, result: TrainResult) -> dict:
    """Evaluate after ``step`` steps; the metrics row's fields."""
    if loop.evaluator is None:
        raise ConfigError("nothing to evaluate on: set eval.path or eval.holdout_documents")
    loop.guard.evaluating(step)
    evaluated = loop.evaluator.evaluate(model)
    result.eval_losses.append((step, evaluated.loss))
    result.eval_preference = evaluated.preference
    return evaluated.metrics()


def _prepare_output(cfg: Config, runtime: Runtime, setup: RunSetup) -> tuple[Config, str, CheckpointManager | None]:
    """``cfg`` with its output directory (``run.output_dir``: made, with the resolved config and run.json:
    meshtron.train.run.segments), this start's id and the checkpoint manager, if any."""
    chosen, run_id = _resolve_output_dir(cfg, runtime)
    cfg = replace(cfg, run=replace(cfg.run, output_dir=chosen))  # a copy: the caller's settings stay as given
    output_dir = Path(chosen)
    runtime.barrier()  # every rank has run its checks on the output directory before rank 0 writes into it
    checkpoints = None
    if cfg.checkpoint.interval > 0 or setup.resume_from:  # first: checks that every rank shares the directory
        checkpoints = CheckpointManager(
            checkpoint_directory(cfg.checkpoint, cfg.run.output_dir),
            cfg.checkpoint.interval,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.async_save,
            runtime,
        )
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        start_segment(cfg, output_dir, setup, runtime.world_size)  # a resumed run keeps its earlier configs
    return cfg, run_id, checkpoints
