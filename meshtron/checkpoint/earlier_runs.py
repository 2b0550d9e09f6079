"""An earlier run of the same settings: a command run again without ``run.output_dir`` starts over in a new
``runs/<timestamp>``; when a run under ``runs/`` already trained the same settings and saved checkpoints, the start
says so in one line, with the setting that resumes it (docs/checkpointing.md#running-the-same-command-again).

Cheap by design: each earlier run's ``config.toml`` and its ``checkpoints/latest`` marker are read, no checkpoint is
loaded. Rank 0 (one process) or the launcher (``--nproc``) asks, before the run's folder is chosen.

What it compares is whole runs' settings, the way their ``config.toml`` records them: so it takes the settings as
that record (``meshtron.config.to_dict``, ``{section: {key: value}}``), not the ``Config``.
"""

from __future__ import annotations

import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.config import load_config, to_dict
from meshtron.errors import MeshtronError

RUNS = Path("runs")
"""Where runs without ``run.output_dir`` go (relative to the working directory)."""

IGNORED_SECTIONS = ("run", "checkpoint", "parallel")
"""Sections that do not change the model trained: outputs and logging, where and how often checkpoints go, and the
layout (every layout trains the same model, and a checkpoint resumes under any layout)."""

IGNORED_KEYS = (
    "fsdp.reshard_after_forward",
    "fsdp.cpu_offload",
    "fsdp.accumulate_unsharded",
    "train.micro_batch_size",
    "train.compile",
    "train.activation_checkpointing",
    "train.mlp_tiles",
    "train.activation_offload",
    "train.loss_chunk_size",
    "train.on_nonfinite",
    "train.max_rollbacks",
    "model.attn_implementation",
    "model.attention_kernel",
    "data.prefetch",
    "data.cache_dir",
    "data.skip_batches",
    "eval.path",
    "eval.interval",
    "eval.batches",
)
"""Settings that change how (or how fast, or with how much memory) the model is computed, not what it is, and
``data.skip_batches``, which a rollback adds to in the earlier run's config and its checkpoints record."""


@dataclass(frozen=True)
class EarlierRun:
    """A folder under ``runs/`` whose run had the same settings, and its newest checkpoint's step."""

    output_dir: Path
    step: int


Settings = dict[str, dict[str, Any]]
"""A run's settings as its config.toml records them: ``{section: {key: value}}`` (meshtron.config.to_dict)."""


def model_settings(settings: Settings) -> dict:
    """Of a run's ``settings``, those that change the model trained, as ``{"section.key": value}``."""
    return {
        f"{section}.{key}": value
        for section, values in settings.items()
        if section not in IGNORED_SECTIONS
        for key, value in values.items()
        if f"{section}.{key}" not in IGNORED_KEYS
    }


def newest_checkpoint_step(checkpoints: Path) -> int | None:
    """The step of the newest checkpoint in ``checkpoints`` by its ``latest`` marker (else by its ``step-N``
    folders), None when there is none. Nothing is opened but the marker."""
    from meshtron.checkpoint.manager import LATEST, PARTIAL

    marker = checkpoints / LATEST
    try:
        names = [marker.read_text().strip()]
    except OSError:
        names = [p.name for p in checkpoints.glob("step-*") if not p.name.endswith(PARTIAL)]
    steps = [int(name.removeprefix("step-")) for name in names if name.removeprefix("step-").isdigit()]
    return max(steps) if steps else None


def _saved_settings(config_file: Path) -> dict | None:
    try:
        with warnings.catch_warnings():  # an old key in an earlier run's file is that run's business
            warnings.simplefilter("ignore")
            return model_settings(to_dict(load_config(config_file, env={})))
    except (MeshtronError, OSError, ValueError):
        return None


def find_earlier_run(settings: Settings, runs: Path = RUNS) -> EarlierRun | None:
    """The newest run under ``runs`` with checkpoints in its own folder and the same ``settings`` (see
    model_settings); None when ``settings`` choose their folder, their checkpoints' folder or a checkpoint to resume,
    or none matches."""
    run, checkpoint = settings["run"], settings["checkpoint"]  # to_dict leaves an unset folder out
    if run.get("output_dir") is not None or checkpoint.get("dir") is not None or checkpoint["resume"] != "auto":
        return None
    if not runs.is_dir():
        return None
    wanted, found = model_settings(settings), []
    for folder in runs.iterdir():
        step = newest_checkpoint_step(folder / "checkpoints") if folder.is_dir() else None
        if step is not None and _saved_settings(folder / "config.toml") == wanted:
            found.append((step, folder.stat().st_mtime, folder))
    if not found:
        return None
    step, _, folder = max(found, key=lambda item: item[1])
    return EarlierRun(folder, step)


def earlier_run_notice(settings: Settings, runs: Path = RUNS) -> str | None:
    """The one line that names an earlier run of the same ``settings`` (find_earlier_run) and how to resume it; None
    when there is none."""
    earlier = find_earlier_run(settings, runs)
    if earlier is None:
        return None
    resume = f"--run.output_dir={shlex.quote(str(earlier.output_dir))}"
    steps = settings["train"]["steps"]
    if earlier.step >= steps:
        return (
            f"meshtron: note: {earlier.output_dir} holds an earlier run of the same settings, finished (checkpoint of "
            f"step {earlier.step}, train.steps={steps}); this one starts over from step 1 in a new folder "
            f"(the same command with {resume} --train.steps=N trains that one on to step N)"
        )
    return (
        f"meshtron: note: {earlier.output_dir} holds an earlier run of the same settings with a checkpoint of step "
        f"{earlier.step} of {steps}; this one starts over from step 1 in a new folder: to resume that one "
        f"instead, run the same command with {resume}"
    )
