"""The precomputed reference (``preference.reference=precomputed``): before the first step of a run, the reference's
per-row log-probabilities of the training and evaluation pairs, computed once with the policy's own starting weights
under the run's own layout, then read with the rows (meshtron.data.reference_logps), so that training holds no
reference model.

The rows are walked in order, in global batches of ``train.global_batch_size`` pairs cut over the data-parallel
ranks and micro-batches as a step cuts them (the last batch filled up with rows from the start, whose results are
dropped); each micro-batch runs forward only through meshtron.train.preference.reference.ReferenceModel on the
policy's modules (with ``[lora]`` its adapters off: the base model; under pipeline parallelism as a forward-only
pipeline, the results on the last stage), in eval mode as the ``model`` reference runs. One all-reduce then gives
every rank the whole array: each row is summed over the ranks that computed it (its data-parallel rank's tensor and
context-parallel copies, the same float32 values) and divided by their number, exact in float64.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from meshtron.config import Config
from meshtron.data.preference import PreferenceDataset
from meshtron.data.reference_logps import FILE_NAME, ReferenceLogps, load_reference_logps, reference_identity
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.distributed.data_parallel import reshard_all
from meshtron.distributed.precision import release_compute_weights
from meshtron.distributed.runtime import Runtime
from meshtron.errors import MeshtronError
from meshtron.train.evaluation.evaluate import eval_mode
from meshtron.train.preference.reference import ReferenceModel
from meshtron.train.preference.targets import unpack_targets
from meshtron.train.setup.build import BuiltModel
from meshtron.train.step import StepContext, device_batches, step_sequences

MODEL_SETTINGS = ("name_or_path", "revision", "preset", "dtype", "max_position_embeddings", "rope_scaling")
"""The ``[model]`` settings that make the starting weights (and so the reference's log-probabilities)."""


def attach_precomputed_reference(
    cfg: Config,
    runtime: Runtime,
    built: BuiltModel,
    ctx: StepContext,
    datasets: tuple[PreferenceDataset, PreferenceDataset | None],
    resuming: bool,
    announce: Callable[[str], None],
) -> None:
    """Give ``datasets`` (training, evaluation) their reference log-probabilities: the run's file if it has one (it
    must match them), else computed now from the starting weights and saved (rank 0). ``resuming``: the run goes on
    from a checkpoint, whose weights are no longer the starting ones, so the file must exist."""
    train, evaluation = datasets
    path = Path(cfg.run.output_dir) / FILE_NAME
    identity = _identity(cfg, train, evaluation)
    started = time.perf_counter()
    if path.exists():
        logps = load_reference_logps(path, identity)
        announce(f"meshtron: reference log-probabilities of {len(train):,} pairs read from {path}")
    elif resuming:
        raise MeshtronError(
            f"preference.reference=precomputed: {path} is missing, and this run resumes from a checkpoint whose "
            "weights are not the starting ones; restore the file, or set preference.reference=model (computed live "
            "from the starting weights)"
        )
    else:
        logps = _compute(cfg, runtime, built, ctx, train, evaluation, identity)
        if runtime.is_main and not runtime.rehearsal:  # a rehearsal's zeros are not kept
            logps.save(path)
        seconds = time.perf_counter() - started
        announce(
            f"meshtron: reference log-probabilities of {len(train):,} pairs computed with the starting weights in "
            f"{seconds:.1f} s, saved to {path}"
        )
    train.attach_reference(logps.train)
    if evaluation is not None:  # the identity holds the evaluation rows' count: so does the file
        evaluation.attach_reference(logps.evaluation)


def _identity(cfg: Config, train: PreferenceDataset, evaluation: PreferenceDataset | None) -> dict:
    model = {name: getattr(cfg.model, name) for name in MODEL_SETTINGS}
    eval_rows = (len(evaluation), evaluation.checksum()) if evaluation is not None else None
    return reference_identity(model, cfg.train.seed, (len(train), train.checksum()), eval_rows)


def _compute(
    cfg: Config,
    runtime: Runtime,
    built: BuiltModel,
    ctx: StepContext,
    train: PreferenceDataset,
    evaluation: PreferenceDataset | None,
    identity: dict,
) -> ReferenceLogps:
    """Both datasets' log-probabilities under the policy's starting weights (zeros in a rehearsal, whose collectives
    move no data)."""
    if runtime.rehearsal:
        zeros = [np.zeros((len(d), 2)) if d is not None else None for d in (train, evaluation)]
        return ReferenceLogps(zeros[0], zeros[1], identity)
    modules = built.runner.modules if built.runner is not None else built.parts
    kind = "lora_base" if cfg.lora.enabled else "model"
    reference = ReferenceModel(kind, modules, built.adapter, ctx.preference.head, ctx.split, built.runner)
    batch = cfg.train.global_batch_size
    with eval_mode(modules):
        logps = [
            reference_logps(dataset, reference, ctx, batch, runtime) if dataset is not None else None
            for dataset in (train, evaluation)
        ]
    release_compute_weights(*modules)
    reshard_all(*modules)  # as evaluation leaves them: the first step finds them as usual
    return ReferenceLogps(logps[0], logps[1], identity)


@torch.no_grad()
def reference_logps(
    dataset: PreferenceDataset, reference: ReferenceModel, ctx: StepContext, global_batch: int, runtime: Runtime
) -> np.ndarray:
    """(rows, 2) float64: every row's reference log-probabilities of its chosen and rejected answers, on every
    rank (every rank calls this together)."""
    count = len(dataset)
    batches = -(-count // global_batch)
    positions = GlobalBatchSchedule(batches * global_batch, global_batch, shuffle=False, seed=0)
    found = torch.zeros(count, 3, dtype=torch.float64)  # the summed (chosen, rejected) and how many ranks gave them
    holds_result = ctx.runner is None or ctx.runner.holds_last
    for number in range(batches):
        for where in step_sequences(positions, number, ctx).micro_batches:
            rows = torch.from_numpy(where % count)
            ((input_ids, target, bounds),) = device_batches([dataset.batch(rows)], ctx)
            labels, runs, _ = unpack_targets(target)
            logps = reference.answer_logps(input_ids, labels, runs, bounds)
            if holds_result:
                kept = torch.from_numpy(where < count)
                found[rows[kept], :2] += logps[kept].float().double().cpu()
                found[rows[kept], 2] += 1
    if runtime.distributed:
        summed = found.to(ctx.device)
        dist.all_reduce(summed)
        found = summed.cpu()
    return (found[:, :2] / found[:, 2:].clamp(min=1)).numpy()
