"""A run in segments: each start that resumes a run with other settings or another layout is a segment of it.

In ``run.output_dir``, ``config.toml`` is always the config of the current segment; once a run has more than one
segment, each keeps its own (``config-from-step-00000006.toml``: the config of the segment that trained from step 6
on), and ``run.json`` lists them (``segments``: first step, layout, world size, tokens per step, config file, the
checkpoint it resumed from) beside the current segment's layout, which ``meshtron plot`` and ``compare`` read
(meshtron.metrics.runs). A start with the same config and layout as the last segment (a restart, the same command
again) goes on in that segment.

A resume whose settings give another learning rate at the resumed step than the checkpointed run's schedule would
have (a cosine schedule stretched by a larger ``train.steps``) says so in one line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from meshtron.checkpoint.manager import read_meta
from meshtron.config import Config, load_config, to_toml
from meshtron.errors import MeshtronError
from meshtron.metrics.runs import RUN_INFO, run_segments
from meshtron.train.optim.build import lr_at

CONFIG = "config.toml"
SEGMENT_CONFIG = "config-from-step-{:08d}.toml"
SCHEDULE_KEYS = (
    "train.steps",
    "optimizer.lr",
    "schedule.min_lr",
    "schedule.warmup_steps",
    "schedule.kind",
    "schedule.decay_fraction",
    "schedule.decay_shape",
)
"""The settings the learning rate at a step depends on (meshtron.train.optim.build.lr_at)."""


def start_segment(cfg: Config, output_dir: Path, setup, world_size: int) -> None:
    """Rank 0, before training: write this start's ``config.toml`` and ``run.json``; on a resume in the run's own
    folder with other settings or another layout, a new segment, the earlier segments' configs kept."""
    first = read_meta(setup.resume_from)["step"] + 1 if setup.resume_from else 1
    text = to_toml(cfg)
    segment = {
        "first_step": first,
        "layout": setup.dims.describe(),
        "world_size": world_size,
        "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
        "config": CONFIG,
        **({"resumed_from": str(setup.resume_from)} if setup.resume_from else {}),
    }
    earlier = _earlier_segments(output_dir, first) if setup.resume_from else []
    if earlier and _same_settings(earlier[-1], segment, text, output_dir):
        segments = earlier
    else:
        if earlier:
            _keep_config(earlier[-1], output_dir)
            segment["config"] = SEGMENT_CONFIG.format(first)
            (output_dir / segment["config"]).write_text(text)
        segments = [*earlier, segment]
    (output_dir / CONFIG).write_text(text)
    current = segments[-1]
    info = {
        "layout": current.get("layout"),
        "world_size": current.get("world_size"),
        "family": setup.hf_config.model_type,
        "tokens_per_step": current.get("tokens_per_step"),
        "segments": segments,
    }
    written = output_dir / (RUN_INFO + ".tmp")
    written.write_text(json.dumps(info, indent=1))
    os.replace(written, output_dir / RUN_INFO)


def _earlier_segments(output_dir: Path, first: int) -> list[dict]:
    """The segments of the run in ``output_dir`` that start before step ``first`` (the later ones are trained
    again); for a run.json written before segments, or none beside a config.toml, one segment from step 1."""
    try:
        info = json.loads((output_dir / RUN_INFO).read_text())
        segments = run_segments(info) if isinstance(info, dict) else []
        segments = [dict(s) for s in segments if isinstance(s, dict) and isinstance(s.get("first_step"), int)]
    except (OSError, ValueError):  # none, or unreadable: what config.toml tells
        segments = []
    if not segments and (output_dir / CONFIG).is_file():
        segments = [{"first_step": 1, "config": CONFIG}]
    return [segment for segment in segments if segment["first_step"] < first]


def _same_settings(segment: dict, new: dict, text: str, output_dir: Path) -> bool:
    if any(segment.get(key) != new[key] for key in ("layout", "world_size", "tokens_per_step")):
        return False
    config = output_dir / str(segment.get("config"))
    return config.is_file() and config.read_text() == text


def _keep_config(segment: dict, output_dir: Path) -> None:
    """Give the segment that ``config.toml`` belongs to a config file of its own, before config.toml is replaced."""
    if segment.get("config") != CONFIG:
        return
    current = output_dir / CONFIG
    if current.is_file():
        segment["config"] = SEGMENT_CONFIG.format(segment["first_step"])
        (output_dir / segment["config"]).write_text(current.read_text())
    else:
        segment.pop("config")


def resume_run(resumable, setup, logger) -> int:
    """Restore the checkpoint the run continues from, if any, and say so (and whether the learning rate jumps);
    the step it starts after."""
    if not setup.resume_from:
        return 0
    meta = resumable.restore(setup.resume_from)
    for line in setup.resume_skipped:
        logger.message(f"meshtron: {line}; skipped it")
    logger.message(f"meshtron: resumed from {setup.resume_from} (step {meta['step']}, saved as {meta['layout']})")
    if logger.enabled:
        saved = _saved_config(setup.resume_from)
        saved_lr = meta["scheduler"].get("_last_lr", [None])[0]  # the rate the checkpointed run would train on with
        if saved_lr is None and saved is not None:
            saved_lr = lr_at(meta["step"], saved)
        lr = resumable.scheduler.optimizer.param_groups[0]["lr"]
        warning = schedule_change_warning(saved, resumable.cfg, meta["step"], saved_lr, lr)
        if warning is not None:
            logger.message(warning)
    return meta["step"]


def _saved_config(checkpoint: Path) -> Config | None:
    """The settings of the run that saved ``checkpoint`` (its config.toml), None if unreadable."""
    try:
        return load_config(Path(checkpoint) / CONFIG, env={})
    except (MeshtronError, OSError):
        return None


def _setting(cfg: Config, dotted: str):
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def schedule_change_warning(
    saved: Config | None, current: Config, step: int, saved_lr: float | None, lr: float
) -> str | None:
    """The warning of a resume after ``step`` steps whose learning rate ``lr`` differs from ``saved_lr``, the one
    the checkpointed run (its settings ``saved``, None when unknown) would have trained step ``step + 1`` with; None
    when the rate is the same (a WSD schedule extended in its stable phase) or the saved one is unknown."""
    if saved_lr is None or math.isclose(saved_lr, lr, rel_tol=1e-6, abs_tol=1e-12):
        return None
    changed = [
        f"{key} {_setting(saved, key)} -> {_setting(current, key)}"
        for key in SCHEDULE_KEYS
        if saved is not None and _setting(saved, key) != _setting(current, key)
    ]
    same_kind = saved is None or saved.schedule.kind == current.schedule.kind
    schedule = f"the {current.schedule.kind} schedule" if same_kind else "the schedule"
    return (
        f"meshtron: warning: {', '.join(changed) or 'the learning-rate settings'} "
        f"change{'s' if len(changed) == 1 else ''} {schedule}: lr at step {step + 1} "
        f"{'jumps' if lr > saved_lr else 'drops'} {saved_lr:.2e} -> {lr:.2e}; the run trains on at the new schedule's "
        "rate (a wsd schedule extended in its stable phase keeps its rate: docs/schedules.md)"
    )
