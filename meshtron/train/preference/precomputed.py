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
    # Rank 0 alone looks at the file and every rank follows its choice: ranks that saw it differently (another node's
    # cache of a shared directory, a directory local to each node) would otherwise run different collectives.
    choice, problem, logps = _agreed_choice(path, identity, resuming, runtime, train, evaluation)
    if choice == "error":
        raise MeshtronError(problem)
    if choice == "load":
        announce(f"meshtron: reference log-probabilities of {len(train):,} pairs read from {path}")
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


def _agreed_choice(
    path: Path,
    identity: dict,
    resuming: bool,
    runtime: Runtime,
    train: PreferenceDataset,
    evaluation: PreferenceDataset | None,
) -> tuple[str, str, ReferenceLogps | None]:
    """(``load`` | ``compute`` | ``error``, the error's line, the loaded log-probabilities): rank 0's decision,
    broadcast, and with ``load`` the file's arrays broadcast from rank 0 (the other ranks need not see the file)."""
    choice, problem, logps = "compute", "", None
    if runtime.is_main:
        if path.exists():
            try:
                logps, choice = load_reference_logps(path, identity), "load"
            except MeshtronError as err:
                choice, problem = "error", str(err)
        elif resuming:
            choice = "error"
            problem = (
                f"preference.reference=precomputed: {path} is missing, and this run resumes from a checkpoint whose "
                "weights are not the starting ones; restore the file, or set preference.reference=model (computed "
                "live from the starting weights)"
            )
    if not runtime.distributed:
        return choice, problem, logps
    device = runtime.device if runtime.device.type == "cuda" else None  # where NCCL stages the objects
    decided = [choice, problem]
    dist.broadcast_object_list(decided, src=0, device=device)
    choice, problem = decided
    if choice == "load":
        logps = _broadcast_logps(logps, identity, runtime, train, evaluation)
    return choice, problem, logps


def _broadcast_logps(
    logps: ReferenceLogps | None,
    identity: dict,
    runtime: Runtime,
    train: PreferenceDataset,
    evaluation: PreferenceDataset | None,
) -> ReferenceLogps:
    """Rank 0's loaded arrays on every rank (one broadcast of float64 on the run's device)."""
    rows = len(train) + (len(evaluation) if evaluation is not None else 0)
    if runtime.is_main:
        parts = [logps.train] + ([logps.evaluation] if evaluation is not None else [])
        both = torch.from_numpy(np.concatenate(parts)).to(runtime.device)
    else:
        both = torch.zeros(rows, 2, dtype=torch.float64, device=runtime.device)
    dist.broadcast(both, src=0)
    values = both.cpu().numpy()
    return ReferenceLogps(values[: len(train)], values[len(train) :] if evaluation is not None else None, identity)


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
    release_compute_weights(*modules)  # (each reference forward resharded its FSDP modules: ReferenceModel)
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
    # On the device, the summed (chosen, rejected) and how many ranks gave them: rows picked on the host (no device
    # sync per micro-batch), added with index_add_ (a row is at most once in a micro-batch once the fill-up is dropped).
    found = torch.zeros(count, 3, dtype=torch.float64, device=ctx.device)
    holds_result = ctx.runner is None or ctx.runner.holds_last
    for number in range(batches):
        for where in step_sequences(positions, number, ctx).micro_batches:
            ((input_ids, target, bounds),) = device_batches([dataset.batch(where % count)], ctx)
            labels, runs, _ = unpack_targets(target)
            logps = reference.answer_logps(input_ids, labels, runs, bounds)
            kept = np.nonzero(where < count)[0]
            if holds_result and len(kept):
                rows = torch.from_numpy(where[kept]).to(ctx.device, non_blocking=True)
                picked = torch.from_numpy(kept).to(ctx.device, non_blocking=True)
                values = logps.index_select(0, picked).double()
                ones = torch.ones(len(kept), 1, dtype=torch.float64, device=ctx.device)
                found.index_add_(0, rows, torch.cat([values, ones], dim=1))
    if runtime.distributed:
        dist.all_reduce(found)
    found = found.cpu()
    if bool((found[:, 2] == 0).any()):  # every row is some rank's: a gap is a bug, never a silent zero reference
        raise MeshtronError(f"preference.reference=precomputed: {int((found[:, 2] == 0).sum())} rows got no value")
    return (found[:, :2] / found[:, 2:]).numpy()
