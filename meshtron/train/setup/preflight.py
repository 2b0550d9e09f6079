"""Checks that run before any collective, identically on every rank and by the launcher: the parallel
degrees, the batch split, the model, data and attention settings, and where the run resumes from.

Where the run resumes from depends on what a rank sees of the checkpoint directory, which can differ between
nodes (a shared file system's cached listings after a restart). In the workers of a multi-process run rank 0
alone resolves it (``checkpoint.resume=auto``, the checks of that checkpoint and of the output directory); once
the process group exists, ``agree_resume_point`` gives every rank rank 0's choice, or raises rank 0's error on
every rank. A launcher (``meshtron train --nproc``) and a single process resolve it here, before anything starts.
Preflight checks a checkpoint's file sizes only; its checksums, which read every byte, are checked then by
``verified_resume_point``, each rank reading its share of the files (meshtron.checkpoint.integrity).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from meshtron.checkpoint.integrity import content_damage
from meshtron.checkpoint.manager import (
    check_fixed_directory,
    checkpoint_directory,
    damaged_error,
    recorded_revision,
    resume_point,
)
from meshtron.config import BUILTIN_CORPUS, Config, ModelConfig, parse_batch_rampup
from meshtron.data.chat import check_chat_tokenizer
from meshtron.data.hub import is_hub_id, main_commit, model_folder, snapshot_commit
from meshtron.data.mixture import parse_sources
from meshtron.data.preference import check_preference_settings
from meshtron.data.shards import check_prepared_tokenizer, is_prepared
from meshtron.data.sources import check_data_path
from meshtron.data.streaming import check_stream_checkpoint
from meshtron.data.tokenizer import (
    BYTE_MODEL_VOCAB,
    ByteTokenizer,
    HFTokenizer,
    check_byte_fallback,
    has_tokenizer,
    load_tokenizer,
    model_vocab_size,
    tokenizer_fingerprint,
    tokenizer_notice,
)
from meshtron.distributed.activation_memory.tiled_mlp import check_mlp_tiles
from meshtron.distributed.data_parallel import check_data_parallel
from meshtron.distributed.float8 import check_float8
from meshtron.distributed.layout_checks import check_layout
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.parallelize import compile_enabled
from meshtron.distributed.precision import precision_policy
from meshtron.distributed.torchrun_env import launched_by_torchrun
from meshtron.errors import ConfigError, MeshtronError
from meshtron.metrics.trackers import check_trackers
from meshtron.models.attention_kernels import check_attention_kernel, resolve_kernel
from meshtron.models.build import check_model_path, check_seq_len, load_hf_config
from meshtron.models.context_extension import check_rope_layout
from meshtron.models.moe import is_moe
from meshtron.models.teacher import (
    check_teacher_positions,
    load_teacher_config,
    pinned_teacher,
    teacher_model_config,
)
from meshtron.resilience.restart import restart_count
from meshtron.train.moe.router_balance import check_router_balance
from meshtron.train.moe.router_loss import router_loss_enabled
from meshtron.train.optim.registry import check_optimizer
from meshtron.train.setup.run_setup import BatchSplit, RunSetup, checkpoint_options

RUN_MARKERS = ("config.toml", "metrics.jsonl")


def micro_batch_split(cfg: Config, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per forward, accumulation_steps) per rank, or a ConfigError if the batch does not split.

    Under pipeline parallelism: (the rank's whole batch, 1), which check_pipeline cuts into pipeline microbatches
    (preflight's BatchSplit holds the result).
    """
    batch, dp = cfg.train.global_batch_size, dims.dp
    rampup = parse_batch_rampup(cfg.train.batch_rampup, batch)
    # With a rampup the first batches are the smallest: by default they run without accumulation.
    micro = cfg.train.micro_batch_size or max(1, (rampup[0] if rampup else batch) // dp)
    if batch % (dp * micro):
        raise ConfigError(
            f"train.global_batch_size {batch} is not divisible by data-parallel degree {dp} x "
            f"train.micro_batch_size {micro} = {dp * micro}; make the global batch a multiple of {dp * micro}"
        )
    if rampup is not None:
        _check_rampup(rampup, dp, micro, dims.pp)
    if dims.pp > 1:
        return batch // dp, 1
    return micro, batch // (dp * micro)


def _check_rampup(rampup: tuple[int, int], dp: int, micro: int, pp: int) -> None:
    start = rampup[0]
    if pp > 1:
        raise ConfigError(
            "train.batch_rampup with parallel.pp > 1 is not supported: the pipeline schedule's microbatch count is "
            "fixed for the run; ramp up without pipeline parallelism, or leave train.batch_rampup empty"
        )
    if start % (dp * micro):
        raise ConfigError(
            f"train.batch_rampup: START {start} is not divisible by data-parallel degree {dp} x "
            f"train.micro_batch_size {micro} = {dp * micro}; every batch of the rampup (a multiple of START) must "
            "split over the data-parallel ranks' micro-batches"
        )


def check_output_dir(output_dir: str | None, resuming: bool = False) -> None:
    """Refuse to write into a directory that already holds a run's outputs, unless continuing that run."""
    if output_dir is None or resuming:
        return
    path = Path(output_dir)
    if any((path / marker).exists() for marker in RUN_MARKERS):
        raise ConfigError(f"run.output_dir '{path}' already holds a run; choose a new run.output_dir")


def check_data_sources(data) -> list[str]:
    """The data paths of the run (``data.path``, or each of ``data.sources``), each checked."""
    if data.format in ("chat", "preference"):
        reads = "conversations" if data.format == "chat" else "preference pairs"
        for setting, wrong, fix in (
            ("data.streaming", data.streaming, "set data.streaming=false"),
            ("data.sources", bool(data.sources), "give one data.path"),
        ):
            if wrong:
                raise ConfigError(f"data.format={data.format} does not work with {setting} yet: {fix}")
        if is_prepared(data.path):
            raise ConfigError(
                f"data.path '{data.path}' is a prepared directory of text; data.format={data.format} reads "
                f"{reads} (.jsonl or a saved dataset)"
            )
    if data.streaming:
        if data.sources:
            raise ConfigError(
                "data.streaming reads one source (data.path), not a mixture (data.sources); prepare the "
                "sources (meshtron data prepare) for a mixture, or set data.streaming=false"
            )
        if is_prepared(data.path):
            raise ConfigError(
                f"data.path '{data.path}' is a prepared directory, memory-mapped as it is; set data.streaming=false"
            )
    if not data.sources:
        check_data_path(data.path)
        return [data.path]
    if data.path != BUILTIN_CORPUS:
        raise ConfigError(
            "data.path and data.sources are both set; keep data.sources for a mixture, or data.path alone"
        )
    paths = [path for path, _ in parse_sources(data.sources)]
    for path in paths:
        check_data_path(path)
    return paths


def revision_notice(repo_id: str, recorded: str, main: str | None) -> str | None:
    """The line saying that a resume trains on the commit its checkpoint records, not where main is now."""
    if main is None or main == recorded:
        return None
    return (
        f"meshtron: model.name_or_path={repo_id}: resuming on commit {recorded[:12]}, which the checkpoint records; "
        f"the hub's main is now {main[:12]} (set model.revision=main to train on it)"
    )


def pinned_model(cfg: Config) -> tuple[ModelConfig, str | None]:
    """``[model]`` with its weights' source fixed: for a model named by hub id, fetched (once per machine) and
    ``model.revision`` set to the commit it resolved to, so every later load, the saved config.toml and the
    checkpoints agree (a resume without ``model.revision`` keeps the commit its checkpoint records); a local folder
    made absolute. With ``revision_notice``'s line, or None. ``cfg`` is left as it is."""
    model = cfg.model
    if not is_hub_id(model.name_or_path):
        if model.name_or_path:  # recorded absolute: an export or resume from another folder finds it
            model = replace(model, name_or_path=os.path.abspath(os.path.expanduser(model.name_or_path)))
        return model, None
    directory = checkpoint_directory(cfg.checkpoint, cfg.run.output_dir)
    recorded = recorded_revision(directory, cfg.checkpoint.resume) if model.revision is None else None
    if recorded:
        model = replace(model, revision=recorded)
    model = replace(model, revision=snapshot_commit(model_folder(model)))
    return model, revision_notice(model.name_or_path, recorded, main_commit(model.name_or_path)) if recorded else None


def preflight(cfg: Config, world_size: int, device_type: str) -> RunSetup:
    """All checks that need no process group, run identically on every rank (and by the launcher)."""
    check_optimizer(cfg.optimizer)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    micro, accumulation = micro_batch_split(cfg, dims)
    check_data_parallel(cfg.fsdp, dims)
    precision = precision_policy(cfg.precision, cfg.model.dtype, cfg.fsdp.reduce_dtype, device_type)
    check_float8(cfg.precision, cfg.model.dtype, device_type, precision)
    check_attention_kernel(cfg.model, cfg.parallel.cp, cfg.data.mask_documents, device_type, precision.name)
    model, notice = pinned_model(cfg)
    cfg = replace(cfg, model=model)  # a copy: the caller's settings are its own (resolved_config)
    check_model_path(cfg.model)
    check_trackers(cfg.run)
    data_paths = check_data_sources(cfg.data)
    if cfg.data.format == "preference":
        check_preference_settings(cfg.data, cfg.preference)
    if cfg.eval.path:
        check_data_path(cfg.eval.path, setting="eval.path")
    # data.tokenizer=auto is resolved here, once: every later use takes setup.tokenizer.
    model_dir = model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code, model_dir)
    check_byte_fallback(cfg.data.tokenizer, model_dir)
    for path in data_paths:
        check_prepared_tokenizer(path, tokenizer)
    if cfg.data.format == "chat":
        check_chat_tokenizer(tokenizer)
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    check_seq_len(hf_config, cfg.data.seq_len)
    check_rope_layout(hf_config, cfg.data.seq_len, dims.cp, cfg.data.mask_documents)
    pp_microbatches = check_layout(
        hf_config,
        cfg.parallel,
        dims,
        seq_len=cfg.data.seq_len,
        mask_documents=cfg.data.mask_documents,
        attn_implementation=cfg.model.attn_implementation,
        local_batch=micro,
        micro_batch_size=cfg.train.micro_batch_size,
        device_type=device_type,
    )
    teacher_model, teacher_config = None, None
    if cfg.train.objective == "distill":
        compute = str(precision.compute_dtype).removeprefix("torch.") if precision.compute_dtype else None
        teacher_model, teacher_config = _teacher(cfg, dims, tokenizer, hf_config, micro, device_type, compute)
    check_mlp_tiles(cfg.train.mlp_tiles, hf_config)
    check_router_balance(cfg.moe.router_balance, hf_config)
    router_loss_enabled(cfg.moe.router_aux_loss, hf_config)  # refuses a router loss the model cannot have
    check_fixed_directory(cfg.checkpoint, cfg.run.output_dir, launched=launched_by_torchrun())
    rank = int(os.environ.get("RANK", "0"))
    by_rank_0 = world_size > 1 and launched_by_torchrun()  # the other ranks learn it from rank 0 (agree_resume_point)
    resume_from, error = None, None
    skipped: list[str] = []
    if rank == 0 or not by_rank_0:
        try:
            resume_from, skipped = _resume_point(cfg, hf_config)
        except MeshtronError as err:
            if not by_rank_0:
                raise
            error = err  # raised on every rank once they can be told
    # Under pp, micro is the rank's whole batch (accumulation 1), cut into pipeline microbatches.
    batch = BatchSplit(micro // pp_microbatches, accumulation, pp_microbatches)
    return RunSetup(
        dims=dims,
        batch=batch,
        tokenizer=tokenizer,
        hf_config=hf_config,
        model=cfg.model,
        teacher_model=teacher_model,
        teacher_config=teacher_config,
        precision=precision,
        compiled=compile_enabled(cfg.train.compile, device_type),
        attention_kernel=resolve_kernel(cfg.model.attention_kernel, device_type),
        resume_from=resume_from,
        resume_skipped=tuple(skipped),
        tokenizer_notice=tokenizer_notice(cfg.data.tokenizer, model_folder(cfg.model)),
        revision_notice=notice,
        resume_agreed=not by_rank_0,
        resume_error=error,
    )


def _teacher(
    cfg: Config, dims: ParallelDims, tokenizer, student_config, local_batch: int, device_type: str, compute: str | None
):
    """(the teacher's model settings, its Hugging Face config) of ``train.objective=distill``, refused in one line
    where its folder, tokenizer, vocabulary or shape does not fit the student and the run's layout (``compute``: the
    run's compute dtype under mixed precision, else None)."""
    teacher_model = pinned_teacher(teacher_model_config(cfg.distill, cfg.model, compute))
    teacher_config = load_teacher_config(teacher_model, tokenizer.vocab_size, student_config)
    folder = model_folder(teacher_model)
    if folder:
        _check_teacher_tokenizer(folder, teacher_model.trust_remote_code, tokenizer, student_config.vocab_size)
    check_teacher_positions(teacher_config, cfg.data.seq_len)
    # The teacher splits its own layers evenly over the pipeline stages (the student's split is the student's).
    own_split = replace(cfg.parallel, pp_first_stage_layers=None, pp_last_stage_layers=None, pp_stage_layers=None)
    # Expert parallelism splits the experts of an MoE teacher; a dense teacher under an MoE student's ep has none.
    teacher_dims = dims if is_moe(teacher_config) else replace(dims, ep=1)
    try:
        check_rope_layout(teacher_config, cfg.data.seq_len, dims.cp, cfg.data.mask_documents)
        check_layout(
            teacher_config,
            own_split,
            teacher_dims,
            seq_len=cfg.data.seq_len,
            mask_documents=cfg.data.mask_documents,
            attn_implementation=cfg.model.attn_implementation,
            local_batch=local_batch,
            micro_batch_size=cfg.train.micro_batch_size,
            device_type=device_type,
        )
    except ConfigError as err:
        raise ConfigError(f"distill.teacher: {err}") from None
    return teacher_model, teacher_config


def _check_teacher_tokenizer(folder: str, trust_remote_code: bool, tokenizer, student_vocab: int) -> None:
    """Refuse a teacher folder made for another tokenizer than the student's data.tokenizer: its own tokenizer of
    another vocabulary (a student on the byte tokenizer too), or, with none, more ids than a model made for bytes
    where the student is one."""
    if has_tokenizer(folder):
        own = HFTokenizer(folder, trust_remote_code, setting="distill.teacher")
        if tokenizer_fingerprint(own) != tokenizer_fingerprint(tokenizer):
            raise ConfigError(
                f"distill.teacher: its tokenizer ({own.vocab_size} ids) is not the student's data.tokenizer "
                f"({tokenizer.vocab_size} ids); a teacher must share the student's token ids: use a teacher of the "
                "same tokenizer"
            )
        return
    size = model_vocab_size(folder)
    if isinstance(tokenizer, ByteTokenizer) and student_vocab <= BYTE_MODEL_VOCAB < (size or 0):
        raise ConfigError(
            f"distill.teacher: {folder} has no tokenizer and its model has {size:,} ids, made for another tokenizer "
            f"than the student's byte tokenizer ({tokenizer.vocab_size} ids); use a teacher of the student's tokenizer"
        )


def _resume_point(cfg: Config, hf_config, altered: dict[Path, str] | None = None) -> tuple[Path | None, list[str]]:
    """(the checkpoint the run continues from, the newer ones skipped as damaged), checked with the output
    directory; a MeshtronError for a checkpoint or directory that cannot be used. ``altered``: checkpoints found
    changed in place (``agree_resume_point``)."""
    skipped: list[str] = []
    resume_from = resume_point(checkpoint_options(cfg), hf_config, skipped, altered)
    check_stream_checkpoint(resume_from, cfg.data.streaming)
    # A restart by torchrun continues this run in its own output directory, with or without a checkpoint.
    check_output_dir(cfg.run.output_dir, resuming=resume_from is not None or restart_count() > 0)
    return resume_from, skipped


def verified_resume_point(setup: RunSetup, runtime, cfg: Config) -> RunSetup:
    """``setup`` (once ``agree_resume_point`` shared rank 0's choice, which preflight made on sizes only) with a
    checkpoint whose bytes are as saved: its checksums checked by all ranks together (integrity.content_damage), and
    with ``checkpoint.resume=auto`` rank 0's next choice while one was changed in place; a checkpoint given by path
    that was changed is an error on every rank."""
    altered: dict[Path, str] = {}
    while setup.resume_from is not None:
        reason = content_damage(setup.resume_from, runtime)
        if reason is None:
            return setup
        if cfg.checkpoint.resume != "auto":
            raise damaged_error(setup.resume_from, "is damaged", reason)
        altered[setup.resume_from] = reason
        setup = agree_resume_point(_choose_again(setup, runtime, cfg, altered), runtime)
    return setup


def _choose_again(setup: RunSetup, runtime, cfg: Config, altered: dict[Path, str]) -> RunSetup:
    """``setup`` with rank 0's resume point (``checkpoint.resume=auto``) once ``altered`` are left out, for
    ``agree_resume_point`` to share."""
    path, error = None, None
    skipped: list[str] = []
    if runtime.is_main or _alone(runtime):
        try:
            path, skipped = _resume_point(cfg, setup.hf_config, altered)
        except MeshtronError as err:
            error = err
        except Exception as err:  # raised on rank 0 alone, it would leave the others waiting in the broadcast
            error = MeshtronError(
                f"checkpoint.resume=auto could not choose a checkpoint again ({err}); set checkpoint.resume "
                "to a step-N folder or to none"
            )
    return replace(setup, resume_from=path, resume_skipped=tuple(skipped), resume_agreed=False, resume_error=error)


def _alone(runtime) -> bool:
    """Whether this rank has no one to agree with: no process group, or a rehearsal's (which moves no data)."""
    return not runtime.distributed or runtime.rehearsal


def agree_resume_point(setup: RunSetup, runtime) -> RunSetup:
    """``setup`` with rank 0's resume point on every rank, learned in one broadcast once the process group exists
    (``runtime``), or rank 0's error raised on every rank; ``setup`` itself where it was resolved by preflight."""
    if setup.resume_agreed:
        return setup
    if _alone(runtime):
        if setup.resume_error is not None:
            raise setup.resume_error
        return replace(setup, resume_agreed=True)
    choice: list = [None]
    if runtime.is_main:
        error = setup.resume_error
        path = str(setup.resume_from) if setup.resume_from is not None else None
        said = None if error is None else (isinstance(error, ConfigError), str(error))
        choice = [(path, list(setup.resume_skipped), said)]
    dist.broadcast_object_list(choice, src=0)
    path, skipped, error = choice[0]
    if error is not None:  # every rank has it: rank 0 prints it (meshtron.exits)
        config_error, message = error
        raise (ConfigError if config_error else MeshtronError)(message)
    return replace(
        setup,
        resume_from=Path(path) if path is not None else None,
        resume_skipped=tuple(skipped),
        resume_agreed=True,
        resume_error=None,
    )
