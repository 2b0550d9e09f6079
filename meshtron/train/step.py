"""One optimizer step: this rank's micro-batches forward and backward, the global loss and gradient
norm, mixed-precision loss scaling, clipping and the optimizer step.

Loss is the sum of token losses over the whole global batch divided by the global number of target
tokens, so it is the same number whatever the layout, micro-batch size or accumulation. Mixture-of-experts
models with the router loss on add ``coef`` times the mean over the accumulation micro-batches of each
global micro-batch's load-balancing loss (meshtron.train.moe.router_loss).

``train_step`` reads as its phases: the batches to the device, the step's scales, forward and backward (the
pipeline schedule's, or the accumulated micro-batches'), the global figures (one all-reduce, one transfer to the
host), fp16's overflow, a non-finite step, the update (clip, optimizer step, router biases, float8 scales).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.config import Config
from meshtron.data.prefetch import StepReader, StepSequences
from meshtron.data.streaming import StreamingDataset
from meshtron.distributed.activation_memory.measure import ResidentStorages, SavedActivationTracker
from meshtron.distributed.activation_memory.offload import ActivationOffloader, saved_activation_hooks
from meshtron.distributed.data_parallel import set_gradient_sync
from meshtron.distributed.float8 import refresh_float8_scales
from meshtron.distributed.grad_norm import clip_gradients
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.precision import PrecisionPolicy, compute_head, release_compute_weights
from meshtron.distributed.tensor_parallel import reduce_partial_gradients, shard_replicated_gradients
from meshtron.errors import MeshtronError
from meshtron.metrics.gradient_memory import held_gradient_bytes
from meshtron.metrics.memory import model_state_bytes
from meshtron.tensors import local_tensor
from meshtron.train.batch import SequenceSplit, host_document_bounds, sequence_inputs, shard_labels
from meshtron.train.loss.head import head_loss_sum
from meshtron.train.loss.preference import preference_runs, target_tokens
from meshtron.train.loss.scaling import LossScaler, unscale_gradients
from meshtron.train.moe.router_balance import RouterBalance
from meshtron.train.moe.router_loss import RouterLoss, StepRouting, router_metrics
from meshtron.train.preference.targets import PairCounts, pack_targets, unpack_targets, with_reference
from meshtron.train.step_stats import global_step_sums, global_target_count, host_values

if TYPE_CHECKING:
    from meshtron.models.adapter import DecoderAdapter
    from meshtron.train.distill.head import DistillHead
    from meshtron.train.moe.pipeline_router_loss import PipelineRouterLoss
    from meshtron.train.pipeline.runner import PipelineRunner
    from meshtron.train.preference.head import PreferenceHead
    from meshtron.train.preference.reference import ReferenceModel
    from meshtron.train.setup.run_setup import RunSetup


@dataclass(frozen=True)
class StepOptions:
    """The settings a step reads, taken once from the run's settings (``step_options``)."""

    loss_chunk_size: int
    """``train.loss_chunk_size``: tokens per chunk of the fused head and loss (0: unchunked)."""
    loss_parallel: bool
    """``parallel.loss_parallel``: the loss over the vocabulary shards under tensor parallelism."""
    accumulate_unsharded: bool
    """``fsdp.accumulate_unsharded``."""
    cpu_offload: bool
    """``fsdp.cpu_offload``: the model state (and the step) on the host."""
    activation_offload: bool
    """``train.activation_offload``."""
    on_nonfinite: str
    """``train.on_nonfinite``: what a step with a NaN or Inf loss or gradient norm does."""
    max_grad_norm: float
    """``optimizer.max_grad_norm``: clipping (0: none)."""
    float8: bool
    """``precision.float8``: float8 weight scales refreshed after each update."""


def step_options(cfg: Config) -> StepOptions:
    """What a step reads of ``cfg``."""
    return StepOptions(
        loss_chunk_size=cfg.train.loss_chunk_size,
        loss_parallel=cfg.parallel.loss_parallel,
        accumulate_unsharded=cfg.fsdp.accumulate_unsharded,
        cpu_offload=cfg.fsdp.cpu_offload,
        activation_offload=cfg.train.activation_offload,
        on_nonfinite=cfg.train.on_nonfinite,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        float8=cfg.precision.float8,
    )


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What every step needs besides the model, optimizer and data (fixed for the run)."""

    dp_rank: int
    setup: RunSetup
    """The run's set-up: degrees, batch split, precision and the like (meshtron.train.setup.preflight)."""
    split: SequenceSplit
    device: torch.device
    options: StepOptions
    adapter: DecoderAdapter
    runner: PipelineRunner | None = None
    """This rank's pipeline stages and schedule, under pipeline parallelism."""
    scaler: LossScaler | None = None
    router: RouterLoss | None = None
    """The MoE router load-balancing loss, when on (meshtron.train.moe.router_loss.build_router_loss)."""
    balance: RouterBalance | None = None
    """The routers' auxiliary-loss-free balancing biases, under ``moe.router_balance=bias``."""
    preference: PreferenceHead | None = None
    """A preference objective's loss on the head (``train.objective`` dpo, ipo, simpo, orpo), else None."""
    reference: ReferenceModel | None = None
    """The reference model of ``dpo`` / ``ipo`` computed live (meshtron.train.preference.reference)."""
    distill: DistillHead | None = None
    """``train.objective=distill``: the loss on the student's and the teacher's heads, with the teacher
    (meshtron.train.distill), else None."""
    precomputed_reference: bool = False
    """``preference.reference=precomputed``: the reference's log-probabilities come with the data's rows
    (meshtron.train.preference.precomputed)."""
    global_sums: Callable[..., tuple] = global_step_sums
    """The step's one all-reduce: (global loss, gradient norm, summed flags) (step_stats.global_step_sums, which the
    run's set-up may wrap)."""

    @property
    def dims(self) -> ParallelDims:
        return self.setup.dims

    @property
    def precision(self) -> PrecisionPolicy:
        return self.setup.precision

    @property
    def loss_parallel(self) -> bool:
        return self.dims.tp > 1 and self.options.loss_parallel


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports: its global figures, whether it updated, and what it was asked to measure."""

    loss: float
    """The global loss (the router loss's share included when it is on)."""
    grad_norm: float
    tokens: float
    """The global batch's labelled tokens."""
    nonfinite: bool = False
    """The loss or gradient norm was NaN/Inf and the step did not update (``train.on_nonfinite``)."""
    metrics: dict = field(default_factory=dict)
    """Metrics beyond loss and gradient norm (the router loss's), for the logger."""
    state_bytes: dict[str, int] | None = None
    """With ``measure_state``: this rank's parameter, gradient and optimizer-state bytes after the update."""
    accumulation_grad_bytes: int = 0
    """With ``measure_state``: the peak gradient bytes held between accumulated micro-batches."""
    activation_bytes: int | None = None
    """With ``measure_activations``: the peak bytes autograd kept for backward (on the device)."""
    offloaded_bytes: int | None = None
    """With ``measure_activations`` and ``train.activation_offload``: the peak bytes offloaded to host memory."""
    flag_sums: tuple[int, ...] = ()
    """The ``shared_flags`` of ``train_step`` summed over all ranks (in the step's own all-reduce)."""


def model_head_loss(model, hidden: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The summed token loss of ``model``'s head on ``hidden`` (the caller holds loss parallel's context)."""
    weight, bias = compute_head(model, ctx.adapter)
    return head_loss_sum(
        hidden,
        labels,
        weight,
        bias,
        compute_dtype=ctx.precision.compute_dtype,
        chunk_size=ctx.options.loss_chunk_size,
        loss_parallel=ctx.loss_parallel,
        softcap=ctx.adapter.logit_softcap(model),
        compiled=ctx.setup.compiled,
    )


def _forward_backward(
    model,
    batches,
    ctx: StepContext,
    scale: float,
    held_grads: list[int] | None = None,
    routing: StepRouting | None = None,
    aux_scale: float = 0.0,
    counts: PairCounts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward and backward of each micro-batch (gradient accumulation); returns the summed token loss (a
    preference objective's: this rank's share of the loss) and a preference objective's metric sums (else None).

    ``batches``: (full token ids, this rank's labels, their document bounds) per micro-batch. ``held_grads``: gets
    the gradient bytes this rank holds after each micro-batch but the last (see meshtron.metrics.gradient_memory).
    ``routing``: with the router loss on, gets each micro-batch's global aux loss; this rank's share of it
    goes into backward times ``aux_scale``.
    """
    local_loss_sum = torch.zeros((), device=ctx.device)
    metric_sums = None
    for index, (input_ids, labels, bounds) in enumerate(batches):
        last = index == len(batches) - 1
        set_gradient_sync(model, last, ctx.options.accumulate_unsharded)
        if ctx.distill is not None:  # the teacher's forward first: only its final hidden states stay
            labels = teacher_targets(input_ids, labels, bounds, ctx)
        with contextlib.ExitStack() as recording:
            if routing is not None:
                recording.enter_context(ctx.router.recording())
            if ctx.balance is not None:
                recording.enter_context(ctx.balance.recording())
            hidden = model(**sequence_inputs(input_ids, ctx.split, bounds))
        aux = None
        if routing is not None:  # one all-reduce of the routers' counts over the dp x cp ranks
            aux = ctx.router.micro_batch()
            routing.add(aux)
        # Vocab-sharded logits under loss parallel: forward and backward of the loss inside its context.
        with loss_parallel() if ctx.loss_parallel else contextlib.nullcontext():
            if ctx.preference is not None:
                loss_sum, share, metrics = preference_loss(model, hidden, labels, ctx, counts)
                metric_sums = metrics if metric_sums is None else metric_sums + metrics
            elif ctx.distill is not None:
                loss_sum, metrics = distill_loss(model, hidden, labels, ctx)
                share = loss_sum
                metric_sums = metrics if metric_sums is None else metric_sums + metrics
            else:
                loss_sum = share = model_head_loss(model, hidden, labels, ctx)
            if aux is None:
                (loss_sum * scale).backward()
            else:  # one backward for both (the LM loss may be a DTensor under loss parallel)
                torch.autograd.backward([loss_sum * scale, aux.share * aux_scale])
        local_loss_sum += local_tensor(share.detach())
        del hidden, loss_sum, share, aux
        if ctx.dims.tp > 1 and not ctx.dims.fsdp_enabled and not last:
            shard_replicated_gradients(model.parameters())
        if held_grads is not None and not last:
            held_grads.append(held_gradient_bytes(model))
    release_compute_weights(model)
    return local_loss_sum, metric_sums


def preference_loss(model, hidden, target, ctx: StepContext, counts: PairCounts | None):
    """(loss to back-propagate, this rank's share of it, metric sums) of a preference micro-batch (the caller holds
    loss parallel's context)."""
    return ctx.preference.loss(hidden, target, *compute_head(model, ctx.adapter), counts)


def teacher_targets(input_ids, labels, bounds, ctx: StepContext) -> torch.Tensor | None:
    """A distillation micro-batch's targets: its labels with the teacher's final hidden states of its sequences
    (meshtron.train.distill.targets); under pipeline parallelism the batch's, on the last stage's rank (None on
    the others, whose schedule takes no targets)."""
    return ctx.distill.teacher.targets(input_ids, labels, bounds)


def distill_loss(model, hidden, target, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss to back-propagate, its cross-entropy and divergence sums) of a distillation micro-batch (the
    caller holds loss parallel's context); the teacher is sharded again once its head is used."""
    result = ctx.distill.loss(hidden, target, *compute_head(model, ctx.adapter))
    ctx.distill.teacher.release()
    return result


def step_sequences(schedule, step: int, ctx: StepContext) -> StepSequences:
    """The packed sequences step ``step`` reads: this rank's micro-batches and the global batch (whose labelled tokens
    every rank counts itself: no collective, no device sync)."""
    micro_batches = schedule.local_micro_batches(step, ctx.dp_rank, ctx.dims.dp, ctx.setup.batch.micro_batch_size)
    if ctx.runner is not None:  # one schedule step; pipeline microbatch m: this rank's slice of global micro-batch m
        micro_batches = [np.concatenate(micro_batches)]
    return StepSequences(tuple(micro_batches), schedule.global_batch(step))


def step_reader(dataset, schedule, ctx: StepContext, prefetch: bool) -> StepReader:
    """The run's StepReader (``data.prefetch``: the next step's batches read while a step trains). A stream is
    told which of its lanes this rank reads (create the reader before restoring a checkpoint)."""
    if isinstance(dataset, StreamingDataset):
        dataset.own(np.concatenate(step_sequences(schedule, 0, ctx).micro_batches))
    return StepReader(
        dataset,
        lambda step: step_sequences(schedule, step, ctx),
        global_target_count,
        prefetch=prefetch,
        pin=ctx.device.type == "cuda",
        count_pairs=pair_counts if ctx.preference is not None else None,
        references=ctx.precomputed_reference,
    )


def pair_counts(dataset, indices: np.ndarray) -> PairCounts:
    """The global batch's pairs and chosen-answer tokens (meshtron.data.preference.PreferenceDataset)."""
    return PairCounts(len(indices), max(1, int(dataset.chosen_token_count(indices))))


def train_step(
    model,
    optimizer,
    inputs: StepReader,
    step: int,
    ctx: StepContext,
    *,
    measure_state: bool = False,
    measure_activations: bool = False,
    shared_flags: Callable[[], Sequence[int]] | None = None,
) -> StepResult:
    """One optimizer step over this rank's micro-batches.

    ``inputs`` gives the step's batches (meshtron.data.prefetch); ``measure_state`` / ``measure_activations``: fill
    those fields of the StepResult; ``shared_flags``: gives this rank's flags
    (meshtron.resilience.guard.RunGuard.step_flags) just before the step's all-reduce, which sums them over the
    ranks into ``StepResult.flag_sums``: no collective or host sync of their own.
    """
    step_inputs = inputs.get(step)
    batches = with_reference_logps(device_batches(step_inputs.micro_batches, ctx, step_inputs.references), ctx)
    counts = step_inputs.pair_counts
    scales = _step_scales(ctx, step_inputs.global_targets, len(batches))
    routing = StepRouting() if ctx.router is not None else None
    (local_loss_sum, metric_sums), measured = _forward_backward_step(
        model,
        batches,
        ctx,
        scales,
        routing,
        counts,
        measure_state=measure_state,
        measure_activations=measure_activations,
    )
    figures = _global_figures(
        model, local_loss_sum, step_inputs.global_targets, ctx, routing, scales, shared_flags, metric_sums, counts
    )
    result = StepResult(
        loss=figures.loss,
        grad_norm=figures.grad_norm,
        tokens=float(step_inputs.global_targets),
        metrics=figures.metrics,
        flag_sums=figures.flag_sums,
        **measured,
    )
    if _loss_scale_overflowed(optimizer, ctx, figures, scales):  # fp16: the step skipped, the scale halved
        return result
    if _nonfinite(step, figures, ctx.options.on_nonfinite):
        _discard_step(optimizer, ctx)
        return replace(result, nonfinite=True)
    metrics = _update(model, optimizer, ctx, figures, scales)
    state_bytes = model_state_bytes(model, optimizer) if measure_state else None
    optimizer.zero_grad(set_to_none=True)
    return replace(result, metrics=metrics, state_bytes=state_bytes)


def device_batches(
    micro_batches, ctx: StepContext, references: Sequence[torch.Tensor] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """(token ids, this rank's labels, their document bounds) of each micro-batch, moved to the device; the tile
    plan's document bounds come from the host copy: no device sync in the forwards. ``references``: each
    micro-batch's precomputed reference log-probabilities (StepInputs.references), packed into its targets."""
    device = ctx.device
    references = references if references is not None else [None] * len(micro_batches)
    return [
        (
            input_ids.to(device, non_blocking=True),
            _device_targets(labels, ctx, reference),
            host_document_bounds(input_ids, ctx.split),
        )
        for (input_ids, labels), reference in zip(micro_batches, references)
    ]


def _device_targets(labels: torch.Tensor, ctx: StepContext, reference: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's labels on the device; a preference objective's packed with each position's answer, found on the
    whole rows before the context-parallel cut, and ``reference``, the rows' precomputed reference
    log-probabilities (meshtron.train.preference.targets)."""
    device = ctx.device
    if ctx.preference is None:
        return shard_labels(labels.to(device, non_blocking=True), ctx.split)
    runs, tokens = preference_runs(labels), target_tokens(labels)  # new host tensors: pinned, the copies are async
    if device.type == "cuda":
        runs, tokens = runs.pin_memory(), tokens.pin_memory()
        reference = reference.pin_memory() if reference is not None else None
    runs = shard_labels(runs.to(device, non_blocking=True), ctx.split)
    local = shard_labels(tokens.to(device, non_blocking=True), ctx.split)
    return pack_targets(local, runs, reference)


def with_reference_logps(batches, ctx: StepContext):
    """The batches with the reference model's per-row log-probabilities in their targets (dpo / ipo with a live
    reference), computed forward only before the policy's forward."""
    if ctx.reference is None:
        return batches
    with_logps = []
    for input_ids, target, bounds in batches:
        labels, runs, _ = unpack_targets(target)
        logps = ctx.reference.answer_logps(input_ids, labels, runs, bounds)
        with_logps.append((input_ids, with_reference(target, logps), bounds))
    return with_logps


@dataclass(frozen=True)
class _Scales:
    """What a step's backward multiplies its losses by."""

    loss: float
    """The LM loss's: FSDP's mean over the dp x cp ranks made a sum, over the global targets, times ``loss_scale``."""
    loss_scale: float
    """fp16's loss scale (1.0 without loss scaling)."""
    aux: float
    """The router loss's share (0.0 without the router loss)."""


def _step_router(ctx: StepContext) -> RouterLoss | PipelineRouterLoss | None:
    """The router loss, when on: the model's, or under pipeline parallelism the one its stages compute in the runner
    (meshtron.train.moe.pipeline_router_loss)."""
    return ctx.router or (ctx.runner.router if ctx.runner is not None else None)


def _step_scales(ctx: StepContext, global_targets: int, micro_batches: int) -> _Scales:
    """The step's scales. The router loss: the mean over the accumulation (or pipeline) micro-batches, scaled for
    FSDP's mean like the LM loss."""
    dims = ctx.dims
    loss_scale = ctx.scaler.scale if ctx.scaler is not None else 1.0
    # FSDP averages gradients over the dp x cp ranks; scaling by dp x cp turns that mean into the sum. A preference
    # objective's loss is already normalized (by the global batch's pairs and chosen tokens).
    scale = dims.dp * dims.cp / (global_targets if ctx.preference is None else 1)
    router = _step_router(ctx)
    accumulation = ctx.setup.batch.pp_microbatches if ctx.runner is not None else micro_batches
    aux_scale = router.coef / accumulation * dims.dp * dims.cp * loss_scale if router is not None else 0.0
    return _Scales(scale * loss_scale, loss_scale, aux_scale)


def _forward_backward_step(
    model,
    batches,
    ctx: StepContext,
    scales: _Scales,
    routing,
    counts: PairCounts | None,
    *,
    measure_state: bool,
    measure_activations: bool,
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], dict]:
    """Forward and backward of the step's batches (the pipeline schedule's, or the accumulated micro-batches'),
    activations offloaded or measured on request; ((the summed token loss, a preference objective's metric sums),
    what was measured: StepResult fields)."""
    offload = ctx.options.activation_offload
    resident = ResidentStorages(model) if measure_activations or offload else None
    tracker = SavedActivationTracker(resident) if measure_activations else None
    offloader = ActivationOffloader(ctx.device, tracker, resident=resident) if offload else None
    measured: dict = {}
    with saved_activation_hooks(offloader, tracker, ctx.runner.modules if ctx.runner is not None else [model]):
        if ctx.runner is not None:
            local_loss_sum = _pipeline_forward_backward(batches, ctx, scales, counts)
        else:
            held_grads: list | None = [] if measure_state else None
            local_loss_sum = _forward_backward(
                model, batches, ctx, scales.loss, held_grads, routing, scales.aux, counts
            )
            if held_grads:
                measured["accumulation_grad_bytes"] = max(held_grads)
    if tracker is not None:
        measured["activation_bytes"] = tracker.peak_bytes
        if offloader is not None:
            measured["offloaded_bytes"] = offloader.peak_offloaded_bytes
    return local_loss_sum, measured


def _pipeline_forward_backward(
    batches, ctx: StepContext, scales: _Scales, counts: PairCounts | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pipeline schedule over this rank's whole batch, which it splits into microbatches itself; the summed
    token loss (and a preference objective's metric sums)."""
    ((input_ids, labels, bounds),) = batches
    if ctx.distill is not None:  # the teacher's pipeline forward over the whole batch, then the student's schedule
        labels = teacher_targets(input_ids, labels, bounds, ctx)
    with ctx.balance.recording() if ctx.balance is not None else contextlib.nullcontext():
        loss = ctx.runner.run(input_ids, labels, scales.loss, scales.aux, bounds, counts)
    if ctx.distill is not None:
        ctx.distill.teacher.release()
    return loss, ctx.runner.step_metric_sums()


@dataclass(frozen=True)
class _GlobalFigures:
    """A step's figures over every rank, from its one all-reduce and one device-to-host transfer."""

    parameters: list
    """This rank's parameters with a gradient."""
    scaled_norm: torch.Tensor
    """The global gradient norm, times the loss scale (on the device)."""
    loss: float
    """The global loss (the router loss's share included when it is on)."""
    grad_norm: float
    metrics: dict
    flag_sums: tuple[int, ...]


def _global_figures(
    model,
    local_loss_sum: torch.Tensor,
    global_targets: int,
    ctx: StepContext,
    routing,
    scales: _Scales,
    shared_flags,
    metric_sums: torch.Tensor | None = None,
    counts: PairCounts | None = None,
) -> _GlobalFigures:
    """Loss shares (only last pipeline stages hold one; tp ranks hold copies), squared gradient norms and the run's
    flags summed in one all-reduce, read with the router's figures in one device-to-host transfer."""
    dims = ctx.dims
    parameters = [p for p in model.parameters() if p.grad is not None]
    if not dims.fsdp_applied(ctx.options.cpu_offload):  # FSDP sums partial tensor-parallel gradients itself
        reduce_partial_gradients(parameters)
    flags = list(shared_flags()) if shared_flags is not None else []
    preference, distill = ctx.preference, ctx.distill
    metric_names = preference.objective.metric_names if preference else distill.metric_names if distill else ()
    if metric_names and metric_sums is None:  # a pipeline rank without the last stage
        metric_sums = torch.zeros(len(metric_names), device=local_loss_sum.device)
    loss, grad_norm, summed_values = ctx.global_sums(
        local_loss_sum,
        parameters,
        global_targets if preference is None else 1,
        loss_copies=dims.tp,
        pipeline_degree=dims.pp,
        flags=flags,
        extra=metric_sums,
    )
    flag_sums, metric_totals = summed_values[: len(flags)], summed_values[len(flags) :]
    pipeline_router = ctx.runner.router if ctx.runner is not None else None
    router_tensors = (
        routing.tensors() if routing is not None else ctx.runner.router_values(ctx.device) if pipeline_router else []
    )
    loss_value, norm_value, *values = host_values(
        loss, grad_norm / scales.loss_scale, *router_tensors, *flag_sums, *metric_totals
    )
    routed, summed = values[: len(router_tensors)], values[len(router_tensors) : len(router_tensors) + len(flag_sums)]
    metrics = {}
    totals = torch.tensor(values[len(router_tensors) + len(flag_sums) :])
    if preference is not None:  # TRL's metrics: means over the global batch's pairs
        metrics = preference.objective.metric_values(totals, counts.pairs)
    elif distill is not None:  # means over the global batch's labelled tokens
        metrics = distill.metric_values(totals, global_targets)
    router = _step_router(ctx)
    if router is not None:  # the reported loss is transformers': LM loss + coef x aux
        metrics = {**metrics, **router_metrics(routed)}
        loss_value += router.coef * metrics["aux_loss"]
    return _GlobalFigures(
        parameters, grad_norm, loss_value, norm_value, metrics, tuple(round(value) for value in summed)
    )


def _discard_step(optimizer, ctx: StepContext) -> None:
    """Drop the step's gradients (and the routers' load of it): the step does not update."""
    optimizer.zero_grad(set_to_none=True)
    if ctx.balance is not None:
        ctx.balance.discard()


def _loss_scale_overflowed(optimizer, ctx: StepContext, figures: _GlobalFigures, scales: _Scales) -> bool:
    """fp16's loss scaling after a step with a finite loss: whether its gradients overflowed at this scale (the step
    is discarded, the scale halved); otherwise the gradients are unscaled."""
    if ctx.scaler is None or not math.isfinite(figures.loss):
        return False
    overflowed = not math.isfinite(figures.grad_norm)
    ctx.scaler.update(overflowed)
    if overflowed:
        _discard_step(optimizer, ctx)
    elif scales.loss_scale != 1.0:
        unscale_gradients(figures.parameters, scales.loss_scale)
    return overflowed


def _nonfinite(step: int, figures: _GlobalFigures, on_nonfinite: str) -> bool:
    """Whether the step's loss or gradient norm is NaN/Inf: a MeshtronError under ``train.on_nonfinite=error``."""
    if math.isfinite(figures.loss) and math.isfinite(figures.grad_norm):
        return False
    if on_nonfinite == "error":
        raise MeshtronError(
            f"step {step + 1}: loss is {figures.loss} and gradient norm is {figures.grad_norm}; training diverged. "
            "Lower optimizer.lr, raise schedule.warmup_steps, check the data, or set train.on_nonfinite=skip or "
            "rollback"
        )
    return True


def _update(model, optimizer, ctx: StepContext, figures: _GlobalFigures, scales: _Scales) -> dict:
    """Clip the gradients, step the optimizer, move the routers' biases by the step's global expert load (reported
    in the metrics it returns) and refresh float8's scales."""
    clip_gradients(figures.parameters, ctx.options.max_grad_norm, figures.scaled_norm / scales.loss_scale)
    optimizer.step()
    metrics = figures.metrics
    if ctx.balance is not None:
        load_max, load_min = ctx.balance.spread(ctx.balance.update())
        metrics = {**metrics, "expert_load_max": load_max, "expert_load_min": load_min}
    if ctx.options.float8:
        refresh_float8_scales(model)
    return metrics
