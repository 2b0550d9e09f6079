"""Saving, finding and loading checkpoints: atomic, retained, resumable under any layout.

On disk (``checkpoint.dir``, default ``<run.output_dir>/checkpoints``)::

    step-00000020/          a complete checkpoint: DCP files (.metadata, __<rank>_0.distcp),
                            meshtron.json (step, scheduler, model and data settings), config.toml,
                            rng-rank<r>.pt (each rank's torch RNG state), data-stream-rank<r>.json
                            (each rank's streamed data position, with data.streaming)
    step-00000030.partial/  a save in progress (or killed); never loaded
    latest                  the name of the newest complete checkpoint

A save goes to ``step-N.partial``; each rank checksums the files it wrote (meshtron.checkpoint.integrity; an async
save in its background thread); once every rank has written, rank 0 adds ``meshtron.json`` (with every file's size
and checksum),
renames the folder to ``step-N`` and then replaces ``latest`` (write + rename), so a run killed at
any moment leaves the previous checkpoint complete and named by ``latest``.

Every rank writes into the folder rank 0 creates, so the directory must be one that all nodes share:
the manager checks that at start-up (every rank writes a file, rank 0 must see them all). A step that
fails on one rank is reported to every rank, rather than leaving them in the next collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from meshtron.checkpoint.integrity import (
    CHECKSUMS,
    FILES,
    META,
    damage,
    file_manifest,
    manifest_checksums,
    rank_checksums,
)
from meshtron.checkpoint.shared_directory import _gather, check_shared_directory, on_every_rank, on_main
from meshtron.checkpoint.state import TrainingState
from meshtron.data.carry import SEQ_LEN_CHANGES
from meshtron.data.hub import is_hub_id
from meshtron.errors import ConfigError, MeshtronError

if TYPE_CHECKING:
    from meshtron.config import CheckpointConfig, DataConfig, ModelConfig
    from meshtron.distributed.runtime import Runtime

LATEST = "latest"
PARTIAL = ".partial"
PROBE = ".meshtron-probe-"
# Model settings that must match between a checkpoint and the run that loads it.
MODEL_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)


DATA_POSITION = "data.position"
"""meshtron.json's [last global batch trained, data position after it] (meshtron.data.sampler.BatchSizes.rebase)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def model_signature(hf_config) -> dict:
    return {key: getattr(hf_config, key, None) for key in MODEL_KEYS}


def read_meta(path: Path) -> dict:
    """meshtron.json of a whole checkpoint, or a clear error for a missing, incomplete or damaged one."""
    reason = damage(path)
    if reason is not None:
        raise damaged_error(path, "is missing or incomplete", reason)
    return json.loads((Path(path) / META).read_text())


def damaged_error(path: Path, what: str, reason: str) -> MeshtronError:
    """The one-line error of a checkpoint given by path that cannot be loaded (``what``: is missing or incomplete,
    is damaged)."""
    return MeshtronError(
        f"checkpoint '{path}' {what}: {reason}; point checkpoint.resume at another step-N folder written by meshtron "
        "(checkpoint.resume=auto falls back to the newest whole one), or use checkpoint.resume=none"
    )


def find_checkpoint(
    directory: Path,
    resume: str,
    skipped: list[str] | None = None,
    altered: dict[Path, str] | None = None,
) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for: None, a given path, or (``auto``) the newest whole one in
    ``directory``; ``skipped`` gets a line for each newer one passed over as damaged (meshtron.checkpoint.integrity).
    ``altered``: checkpoints already found changed in place ({path: reason}: integrity.content_damage)."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        read_meta(path)
        if altered and path in altered:
            raise damaged_error(path, "is damaged", altered[path])
        return path
    return first_whole_checkpoint(directory, checkpoint_candidates(directory), skipped, altered)


def checkpoint_candidates(directory: Path) -> list[Path]:
    """The complete checkpoint folders in ``directory``, newest first (``latest``'s first)."""
    # Newest first; a complete folder newer than `latest` is a run killed between the rename and the marker.
    candidates = (
        sorted((p for p in directory.glob("step-*") if p.is_dir() and not p.name.endswith(PARTIAL)), reverse=True)
        if directory.is_dir()
        else []
    )
    marker = directory / LATEST
    latest = directory / marker.read_text().strip() if marker.is_file() else None
    if latest is not None and latest not in candidates:
        candidates.insert(0, latest)
    return candidates


def first_whole_checkpoint(
    directory: Path,
    candidates: list[Path],
    skipped: list[str] | None = None,
    altered: dict[Path, str] | None = None,
) -> Path | None:
    """The first of ``candidates`` (in ``directory``) that is whole; ``skipped`` and ``altered`` as for
    ``find_checkpoint``. A MeshtronError when every one is damaged."""
    reasons: list[str] = []
    for path in candidates:
        reason = (altered or {}).get(path) or damage(path)
        if reason is None:
            if skipped is not None:
                skipped.extend(reasons)
            return path
        reasons.append(f"checkpoint {path.name} is damaged ({reason})")
    if reasons:
        raise MeshtronError(
            f"no whole checkpoint to resume from in '{directory}': {'; '.join(reasons)}; use checkpoint.resume=none "
            "to start over (in a new run.output_dir) or restore a checkpoint"
        )
    return None


def check_compatible(meta: dict, path: Path, hf_config, data_cfg, global_batch_size: int) -> None:
    """Refuse a checkpoint of another model or another data layout, naming what differs."""
    ours = model_signature(hf_config)
    differs = [
        f"{key} {meta['model'].get(key)} (checkpoint) vs {ours[key]} (this run)"
        for key in MODEL_KEYS
        if meta["model"].get(key) != ours[key]
    ]
    if differs:
        raise ConfigError(
            f"checkpoint '{path}' is of another model: {'; '.join(differs)}; use the model it was saved with"
        )
    # A checkpoint that records its data position (DATA_POSITION) resumes with any global batch size and, on one
    # corpus, any sequence length (meshtron.data.carry).
    if DATA_POSITION not in meta:
        settings = [("data.seq_len", data_cfg.seq_len, ""), ("train.global_batch_size", global_batch_size, "")]
    else:
        fixed_by = [
            setting
            for setting, used in (
                ("data.sources", bool(data_cfg.sources)),
                (f"data.format={data_cfg.format}", data_cfg.format != "text"),
                ("data.streaming", data_cfg.streaming),
            )
            if used
        ]
        settings = [("data.seq_len", data_cfg.seq_len, f" (not with {fixed_by[0]})")] if fixed_by else []
        if fixed_by and SEQ_LEN_CHANGES in meta:
            raise ConfigError(
                f"checkpoint '{path}' goes on from a change of data.seq_len, whose rest of the epoch is cut from one "
                f"corpus (data.path); resume it on that corpus, not with {fixed_by[0]}"
            )
    for key, value, why in settings:
        if meta[key] != value:
            raise ConfigError(
                f"checkpoint '{path}' was saved with {key}={meta[key]} but this run has {value}; the data "
                f"position would not carry over{why}: resume with {key}={meta[key]}"
            )


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every save/load without a process group that it assumes one process: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")
        yield


def _check_exception(err: BaseException) -> str:
    """A one-line reason for an OSError or DCP's CheckpointException (which holds each failed rank's error)."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (exc, _) = next(iter(sorted(err.failures.items())))
        return f"rank {rank}: {exc}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


class CheckpointManager:
    """Saves every ``checkpoint.interval`` steps (sync or async), keeps the last ``keep_last``, loads one.

    Created by every rank at start-up: checks that ``directory`` is one folder all ranks share.
    """

    def __init__(self, directory: Path, interval: int, keep_last: int, async_save: bool, runtime: Runtime):
        self.directory, self.interval, self.keep_last, self.async_save = directory, interval, keep_last, async_save
        self.runtime = runtime
        # (future, step, partial dir, meta, timing) of an async save not yet committed
        self.pending: tuple | None = None
        # the thread that checksums an async save's files once they are written
        self._checksummer: ThreadPoolExecutor | None = None
        self._asked: tuple | None = None  # the pending save that ``unfinished`` last looked at
        self.on_commit: Callable[[int, Path, float, float | None], None] | None = None
        """Called on every rank once a save is complete: ``on_commit(step, path, seconds, paused)``, ``seconds``
        from the start of the save, ``paused`` (async saves; None for others) how long training waited for it."""
        # Async saves run collectives from a background thread: give them a group of their own.
        self.group = dist.new_group(backend="gloo") if async_save and runtime.distributed else None

        def prepare() -> tuple[Path, list[str]]:
            directory.mkdir(parents=True, exist_ok=True)
            partial = sorted(path.name for path in directory.glob(f"*{PARTIAL}"))
            for stale in [*directory.glob(f"*{PARTIAL}"), *directory.glob(f"{PROBE}*")]:  # left by a killed run
                shutil.rmtree(stale, ignore_errors=True)
            probe = directory / f"{PROBE}{uuid.uuid4().hex[:12]}"
            probe.mkdir()
            return probe, partial

        probe, self.removed_partial = on_main(
            runtime,
            prepare,
            lambda reason: ConfigError(
                f"checkpoint directory '{directory}' cannot be used ({reason}); set checkpoint.dir (or run.output_dir) "
                "to a writable directory"
            ),
        )
        check_shared_directory(directory, probe, runtime)

    def due(self, step: int, last_step: int) -> bool:
        return self.interval > 0 and (step % self.interval == 0 or step == last_step)

    def _failed(self, partial: Path, reason: str, uniform: bool = True) -> MeshtronError:
        return MeshtronError(
            f"saving checkpoint {partial.name} failed ({reason}); free disk space, make checkpoint.dir writable or "
            "change it (earlier checkpoints are untouched)",
            uniform=uniform,
        )

    def save(
        self, step: int, state: TrainingState, meta: dict, config_text: str, rank_files: dict[str, str] | None = None
    ) -> None:
        """Write a checkpoint of the state after ``step`` optimizer steps; ``rank_files``: this rank's own small
        files (name -> text), written beside its RNG state."""
        self.wait()
        started = time.perf_counter()
        partial = self.directory / (step_dir_name(step) + PARTIAL)

        def start() -> None:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            (partial / "config.toml").write_text(config_text)

        on_main(self.runtime, start, lambda reason: self._failed(partial, reason))
        rng_file = partial / f"rng-rank{self.runtime.rank}.pt"

        def write_rank_files() -> None:
            torch.save(torch.get_rng_state(), rng_file)
            for name, text in (rank_files or {}).items():
                (partial / name).write_text(text)

        on_every_rank(self.runtime, write_rank_files, lambda reason: self._failed(partial, reason))
        self._write_state(step, state, partial, meta, started)
        own = (rng_file.name, *(rank_files or {}))
        if self.async_save:
            written, *rest = self.pending
            self.pending = (self._checksums_once_written(written, partial, own), *rest)
        else:
            self._commit(step, partial, meta, (started, None), self._own_checksums(partial, own))

    def _own_checksums(self, partial: Path, own: tuple[str, ...]) -> dict[str, int] | str:
        """{name: crc32} of the files this rank wrote into ``partial``, or why they cannot be read back (the commit
        then fails the save on every rank)."""
        try:
            return rank_checksums(partial, self.runtime.rank, own)
        except OSError as err:
            return f"rank {self.runtime.rank}: {err}"

    def _checksums_once_written(self, written: Future, partial: Path, own: tuple[str, ...]) -> Future:
        """A future of this rank's checksums (``_own_checksums``), computed in the background once the async write
        ``written`` is done (which raises its error instead)."""
        if self._checksummer is None:
            self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="meshtron-checksums")

        def checksum() -> dict[str, int] | str:
            written.result()
            return self._own_checksums(partial, own)

        return self._checksummer.submit(checksum)

    def _write_state(self, step: int, state: TrainingState, partial: Path, meta: dict, started: float) -> None:
        """Write this rank's part of ``state`` into ``partial``; an async save starts writing it and is ``pending``
        until its commit. (A test's fault plan wraps this: its save faults fire once it returns.)"""
        try:
            with quiet_single_process():
                if self.async_save:
                    future = dcp.async_save(
                        state.state_dict(),
                        checkpoint_id=str(partial),
                        process_group=self.group,
                        no_dist=not self.runtime.distributed,
                    )
                    self.pending = (future, step, partial, meta, (started, time.perf_counter() - started))
                    return
                dcp.save(state.state_dict(), checkpoint_id=str(partial), no_dist=not self.runtime.distributed)
        except (OSError, CheckpointException) as err:  # DCP gathers every rank's failure and raises on all
            raise self._failed(partial, _check_exception(err), uniform=isinstance(err, CheckpointException)) from None

    def unfinished(self) -> int:
        """1 while this rank still writes its part of an async save, else 0: a flag of the step's all-reduce (which
        sums it over the ranks, meshtron.train.step_stats) for ``commit_if_done``."""
        self._asked = self.pending
        return int(self.pending is not None and not self.pending[0].done())

    def commit_if_done(self, unfinished_ranks: int) -> None:
        """Commit an async save as soon as every rank has written its part (every rank calls this after each
        step), so that a run killed before the next save resumes from it. ``unfinished_ranks``: ``unfinished()``
        summed over the ranks in the step; a save started since then waits for the next step's."""
        if self.pending is not None and self.pending is self._asked and unfinished_ranks == 0:
            self.wait()

    def wait(self) -> None:
        """Finish and commit an async save still in flight (every rank calls this at the same point)."""
        if self.pending is None:
            return
        future, step, partial, meta, timing = self.pending
        self.pending = None
        try:
            checksums = future.result()
        except (OSError, CheckpointException) as err:
            raise self._failed(partial, _check_exception(err), uniform=isinstance(err, CheckpointException)) from None
        self._commit(step, partial, meta, timing, checksums)

    def _commit(
        self, step: int, partial: Path, meta: dict, timing: tuple[float, float | None], checksums: dict[str, int] | str
    ) -> None:
        """Make the written ``partial`` folder checkpoint ``step``; ``timing``: (when the save started, how long
        training paused for an async one); ``checksums``: of the files this rank wrote (``_own_checksums``)."""
        by_ranks = _gather(self.runtime, checksums)  # also: every rank has written its shards
        unreadable = [sums for sums in by_ranks if isinstance(sums, str)]
        if unreadable:
            raise self._failed(partial, unreadable[0])

        def commit() -> None:
            # Every file with its size and checksum, so that a resume can tell a damaged checkpoint (integrity).
            sizes = file_manifest(partial)
            recorded = {FILES: sizes, CHECKSUMS: manifest_checksums(partial, sizes, by_ranks)}
            (partial / META).write_text(json.dumps({**meta, **recorded}, indent=1))
            final = self.directory / step_dir_name(step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            marker = self.directory / (LATEST + ".tmp")
            marker.write_text(final.name)
            os.replace(marker, self.directory / LATEST)
            self._prune(final)

        on_main(self.runtime, commit, lambda reason: self._failed(partial, reason))
        if self.on_commit is not None:
            started, paused = timing
            self.on_commit(step, self.directory / step_dir_name(step), time.perf_counter() - started, paused)

    def _prune(self, newest: Path) -> None:
        if self.keep_last <= 0:
            return
        complete = sorted(p for p in self.directory.glob("step-*") if p.is_dir() and not p.name.endswith(PARTIAL))
        for old in complete[: -self.keep_last]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, state: TrainingState) -> dict:
        """Load ``path`` into the model and optimizer (any layout); restore this rank's RNG if the world matches."""
        meta = read_meta(path)
        loaded = state.state_dict()
        try:
            with quiet_single_process():
                dcp.load(loaded, checkpoint_id=str(path), no_dist=not self.runtime.distributed)
        except Exception as err:  # noqa: BLE001 - DCP raises many types for a broken or foreign checkpoint
            raise MeshtronError(f"checkpoint '{path}' could not be loaded: {str(err).splitlines()[0]}") from None
        state.load_state_dict(loaded)
        rng = path / f"rng-rank{self.runtime.rank}.pt"
        if meta.get("world_size") == self.runtime.world_size and rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        return meta


@dataclass(frozen=True)
class CheckpointOptions:
    """What finding, checking and recording a checkpoint reads of a run's settings, resolved once by the train layer
    (meshtron.train.setup.run_setup.checkpoint_options) from the settings preflight resolved."""

    directory: Path | None
    """``checkpoint_directory``: None when neither ``checkpoint.dir`` nor ``run.output_dir`` is known yet."""
    resume: str
    """``checkpoint.resume``: none, auto or a checkpoint's path."""
    data: DataConfig
    """``[data]``, which a checkpoint's data layout is checked against (``check_compatible``)."""
    global_batch_size: int
    lora_base: dict | None = None
    """``lora_base`` of a LoRA run, None without LoRA."""
    hub_revision: dict = field(default_factory=dict)
    """``hub_revision``: the hub commit of a model named by hub id, else empty."""


def checkpoint_directory(checkpoint: CheckpointConfig, output_dir: str | None) -> Path | None:
    """``checkpoint.dir``, or ``<run.output_dir>/checkpoints``; None when neither is known yet."""
    if checkpoint.dir:
        return Path(checkpoint.dir)
    return Path(output_dir) / "checkpoints" if output_dir else None


def check_fixed_directory(checkpoint: CheckpointConfig, output_dir: str | None, launched: bool) -> None:
    """Under torchrun (``launched``), saving needs a directory a restart finds again, not ``runs/<timestamp>``."""
    if launched and checkpoint.interval > 0 and checkpoint_directory(checkpoint, output_dir) is None:
        raise ConfigError(
            "checkpoint.interval > 0 under torchrun needs a fixed directory: without run.output_dir or checkpoint.dir "
            "every start writes to a new runs/<timestamp> and a restart never resumes; set run.output_dir "
            "(or checkpoint.dir)"
        )


def resume_point(
    options: CheckpointOptions,
    hf_config,
    skipped: list[str] | None = None,
    altered: dict[Path, str] | None = None,
) -> Path | None:
    """The checkpoint this run continues from (checked against the model and data settings), or None;
    ``skipped``, ``altered``: as for ``find_checkpoint``."""
    if options.resume == "auto" and options.directory is None:
        return None
    path = find_checkpoint(options.directory, options.resume, skipped, altered)
    if path is not None:
        meta = read_meta(path)
        check_compatible(meta, path, hf_config, options.data, options.global_batch_size)
        check_lora_checkpoint(meta, path, options.lora_base)
    return path


MODEL_REVISION = "model.revision"
"""meshtron.json's record of the hub commit the run's model (a hub id) was resolved to, so a resume trains on it."""


def hub_revision(model: ModelConfig) -> dict:
    """``{"model.revision": commit}`` for a model named by hub id (preflight pinned the commit), else nothing."""
    return {MODEL_REVISION: model.revision} if is_hub_id(model.name_or_path) else {}


def recorded_revision(directory: Path | None, resume: str) -> str | None:
    """The hub commit that the checkpoint a resume would continue from records, or None (``directory``,
    ``resume``: as for ``find_checkpoint``); a quick look, before the model is loaded (``resume_point`` checks that
    checkpoint properly afterwards)."""
    if resume == "none" or (resume == "auto" and directory is None):
        return None
    try:
        path = find_checkpoint(directory, resume)
        return read_meta(path).get(MODEL_REVISION) if path is not None else None
    except (MeshtronError, OSError, ValueError):
        return None


LORA_BASE = "lora.base"
"""meshtron.json's record, in a LoRA run's checkpoints (which hold only what trains), of the frozen base."""


def lora_base(model: ModelConfig, seed: int) -> dict:
    """Where a LoRA run's frozen base weights come from: a model directory, or a preset initialized from ``seed``
    (``train.seed``)."""
    if model.name_or_path:
        return {"model.name_or_path": model.name_or_path, **hub_revision(model)}
    return {"model.preset": model.preset, "train.seed": seed}


def _absolute_base(base: dict) -> dict:
    """``lora_base``'s record with a local folder made absolute (a checkpoint of an older run may hold it as given)."""
    name = base.get("model.name_or_path")
    if name and not is_hub_id(name):
        return {**base, "model.name_or_path": os.path.abspath(os.path.expanduser(name))}
    return base


def check_lora_checkpoint(meta: dict, path: Path, base: dict | None) -> None:
    """Refuse a resume that would put a LoRA checkpoint's adapters on another base, or mix LoRA and full runs
    (``base``: this run's ``lora_base``, None without LoRA)."""
    saved = meta.get(LORA_BASE)
    if saved is None and base is not None:
        raise ConfigError(
            f"checkpoint '{path}' is of a run without LoRA; to fine-tune it with LoRA, export it (meshtron export) and "
            "set model.name_or_path to the export"
        )
    if saved is not None and base is None:
        raise ConfigError(
            f"checkpoint '{path}' holds only LoRA adapters (and what else trained); resume it with its [lora] "
            "settings, or export it merged (meshtron export) and train the export"
        )
    if saved is not None and _absolute_base(saved) != _absolute_base(base):
        differs = ", ".join(f"{key}={value}" for key, value in saved.items())
        raise ConfigError(f"checkpoint '{path}' holds LoRA adapters of another base ({differs}); resume with that base")


def checkpoint_meta(step: int, scheduler, hf_config, options: CheckpointOptions, runtime: Runtime, layout: str) -> dict:
    """What meshtron.json records besides the tensors."""
    return {
        **({LORA_BASE: options.lora_base} if options.lora_base is not None else {}),
        **options.hub_revision,
        "step": step,
        "scheduler": scheduler.state_dict(),
        "model": model_signature(hf_config),
        "train.global_batch_size": options.global_batch_size,
        "data.seq_len": options.data.seq_len,
        "world_size": runtime.world_size,
        "layout": layout,
    }
