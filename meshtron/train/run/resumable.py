"""What a checkpoint holds of a run (weights, optimizer, LR schedule, loss scale, skipped batches, a stream's
position), saved
and restored together: at the save interval, at a stop by signal, at resume and at a rollback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from meshtron.checkpoint.manager import DATA_POSITION, CheckpointManager, checkpoint_directory, checkpoint_meta
from meshtron.checkpoint.state import TrainingState
from meshtron.config import Config, to_toml
from meshtron.data.carry import SEQ_LEN_CHANGES, resume_with_changes
from meshtron.data.streaming import StreamingDataset, load_stream_states, save_stream_state
from meshtron.train.optim.build import apply_schedule
from meshtron.train.run.messages import saved_message
from meshtron.train.setup.run_setup import checkpoint_options

if TYPE_CHECKING:
    from torch import nn
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PretrainedConfig

    from meshtron.data.chat import ChatDataset
    from meshtron.data.dataset import PackedDataset
    from meshtron.data.mixture import MixedDataset
    from meshtron.data.preference import PreferenceDataset
    from meshtron.data.sampler import GlobalBatchSchedule
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.loss.scaling import LossScaler

SKIPPED_KEY = "data.skip_batches"
"""meshtron.json's list of the global batches the run leaves out (data.skip_batches and rollbacks)."""


@dataclass(kw_only=True)
class Resumable:
    cfg: Config
    runtime: Runtime
    checkpoints: CheckpointManager | None
    """None when the run saves nothing (checkpoint.interval 0) until a stop by signal needs one."""
    state: TrainingState
    scheduler: LRScheduler
    scaler: LossScaler | None
    """The fp16 loss scaler, or None."""
    schedule: GlobalBatchSchedule
    """The run's batch order, whose skipped batches a checkpoint records."""
    hf_config: PretrainedConfig
    layout: str
    parts: list[nn.Module]
    """The model parts (float8 weight scales are refreshed from restored weights)."""
    on_save: Callable[[], None] | None = None
    """Called after each save (NonfiniteRollback.checkpoint_saved)."""
    stream: StreamingDataset | None = None
    """The StreamingDataset of a ``data.streaming`` run, whose position each rank saves and restores."""
    dataset: PackedDataset | MixedDataset | ChatDataset | PreferenceDataset | StreamingDataset | None = None
    """The training dataset; a resume with another ``data.seq_len`` gives it the rest of the epoch to read
    (meshtron.data.carry)."""
    seq_len_changes: list = field(default_factory=list)
    """The run's changes of ``data.seq_len`` so far (meshtron.data.carry.SEQ_LEN_CHANGES), saved in checkpoints."""
    announce: Callable[[str], None] | None = None
    """Prints a line on rank 0 (the MetricsLogger's ``message``): each complete save's one-line report."""
    latest: tuple[int, Path] | None = None
    """(step, folder) of the run's newest checkpoint: the last one this start saved, or the one it resumed from."""

    def __post_init__(self):
        self._watch(self.checkpoints)

    def _watch(self, checkpoints: CheckpointManager | None) -> None:
        if checkpoints is not None:
            checkpoints.on_commit = self._saved

    def _saved(self, step: int, path: Path, seconds: float, paused: float | None) -> None:
        self.latest = (step, path)
        if self.announce is not None:
            self.announce(saved_message(step, path, seconds, paused))

    def save_due(self, step: int) -> bool:
        return self.checkpoints is not None and self.checkpoints.due(step, self.cfg.train.steps)

    def save(self, step: int, stopped_by: str | None = None) -> None:
        """Save the state after ``step`` steps (``stopped_by``: the signal that stopped the run)."""
        if self.checkpoints is None:  # every rank got here together: the set-up's collectives are safe
            directory = checkpoint_directory(self.cfg.checkpoint, self.cfg.run.output_dir)
            self.checkpoints = CheckpointManager(directory, 0, self.cfg.checkpoint.keep_last, False, self.runtime)
            self._watch(self.checkpoints)
        options = checkpoint_options(self.cfg)
        meta = checkpoint_meta(step, self.scheduler, self.hf_config, options, self.runtime, self.layout)
        meta[SKIPPED_KEY] = sorted(self.schedule.skipped_batches)
        meta[DATA_POSITION] = list(self.schedule.position_after(step))
        if self.seq_len_changes:
            meta[SEQ_LEN_CHANGES] = self.seq_len_changes
        if self.scaler is not None:
            meta["loss_scaler"] = self.scaler.state_dict()
        if stopped_by:
            meta["stopped_by"] = stopped_by
        rank_files = None
        if self.stream is not None:  # the position before the next global batch the run trains
            rank_files = save_stream_state(self.stream, self.schedule.batch_number(step) - 1, self.runtime.rank)
        self.checkpoints.save(step, self.state, meta, to_toml(self.cfg), rank_files)
        if self.on_save is not None:
            self.on_save()

    def unfinished_save(self) -> int:
        """1 while this rank still writes an async save (CheckpointManager.unfinished), else 0."""
        return self.checkpoints.unfinished() if self.checkpoints is not None else 0

    def commit_if_done(self, unfinished_ranks: int) -> None:
        if self.checkpoints is not None:
            self.checkpoints.commit_if_done(unfinished_ranks)

    def wait(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.wait()

    def restore(self, path: Path) -> dict:
        """Load checkpoint ``path`` into the model, optimizer, LR schedule, loss scale and data order; its meta."""
        meta = self.checkpoints.load(path, self.state)
        base_lrs = list(self.scheduler.base_lrs)  # this run's optimizer.lr, not the checkpointed run's
        self.scheduler.load_state_dict(meta["scheduler"])
        self.scheduler.base_lrs = base_lrs
        apply_schedule(self.scheduler)
        self.latest = (meta["step"], Path(path))
        if self.scaler is not None and "loss_scaler" in meta:
            self.scaler.load_state_dict(meta["loss_scaler"])
        self.schedule.skip(meta.get(SKIPPED_KEY, []))
        if DATA_POSITION in meta:  # on from where it stopped, whatever global batch size it trained with
            self.schedule.sizes.rebase(*meta[DATA_POSITION])
            self._carry_over(meta)
        if self.stream is not None:
            self.stream.restore(load_stream_states(path))
        if self.cfg.precision.float8:
            from meshtron.distributed.float8 import refresh_float8_scales

            refresh_float8_scales(self.parts)
        return meta

    def _carry_over(self, meta: dict) -> None:
        """After a checkpoint saved with another ``data.seq_len`` (or after one that followed such a change), read the
        rest of its epoch cut to this run's length first (meshtron.data.carry)."""
        changes = list(meta.get(SEQ_LEN_CHANGES, []))
        if meta["data.seq_len"] != self.cfg.data.seq_len:
            changes.append([meta[DATA_POSITION][1], meta["data.seq_len"], self.cfg.data.seq_len])
        self.seq_len_changes = changes
        if changes:
            resume_with_changes(self.dataset, self.schedule, changes, self.cfg.data.shuffle, self.cfg.data.seed)
