"""Reading a finished (or running) run's directory: its metrics rows, layout and sizes (no torch import: the
``meshtron`` command line loads this to build its parser)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from meshtron.errors import ConfigError

METRICS = "metrics.jsonl"
RUN_INFO = "run.json"


@dataclass
class Run:
    path: Path
    rows: list[dict]
    """The last row logged for each step (a restart logs some steps again), in step order."""
    info: dict
    """run.json: layout, world_size, family, tokens_per_step of the run's latest segment, and its ``segments``
    (empty for runs older than run.json)."""

    @property
    def segments(self) -> list[dict]:
        """The parts of the run that each start trained with one config and layout, oldest first (see
        ``run_segments``)."""
        return run_segments(self.info)

    @property
    def label(self) -> str:
        """The run's folder name with its layout, or its layouts and the steps they start from after a resume under
        another layout: ``a (dp_shard=4; from step 4: dp_shard=2 tp=2)``."""
        shown: list[tuple[int, str]] = []
        for segment in self.segments:
            layout = segment.get("layout")
            if layout and (not shown or layout != shown[-1][1]):
                shown.append((segment["first_step"], layout))
        if not shown:
            return self.path.name
        layouts = [shown[0][1]] + [f"from step {first}: {layout}" for first, layout in shown[1:]]
        return f"{self.path.name} ({'; '.join(layouts)})"

    def column(self, key: str) -> list[float | None]:
        return [row.get(key) for row in self.rows]

    @property
    def evaluations(self) -> dict[int, float]:
        """{step: evaluation loss} of the steps that evaluated (``[eval]``)."""
        return {row["step"]: row["eval_loss"] for row in self.rows if row.get("eval_loss") is not None}

    @property
    def steps(self) -> list[int]:
        return [row["step"] for row in self.rows]

    @property
    def tokens(self) -> list[float] | None:
        """Tokens trained on after each step (global batch x sequence length, summed over the steps), when known;
        each segment with its own tokens per step (a resume may change the global batch or the sequence length)."""
        segments = self.segments
        if len(segments) > 1 and all(segment.get("tokens_per_step") for segment in segments):
            return [_tokens_after(step, segments) for step in self.steps]
        per_step = self.info.get("tokens_per_step")
        return [per_step * step for step in self.steps] if per_step else None


def run_segments(info: dict) -> list[dict]:
    """run.json's ``segments`` ({first_step, layout, world_size, tokens_per_step, config, ...} each), or for a
    run.json written before segments one made of its layout, world size and tokens per step ([] for no run.json)."""
    if "segments" in info:
        return info["segments"]
    if not info:
        return []
    keys = ("layout", "world_size", "tokens_per_step")
    return [{"first_step": 1, **{key: info[key] for key in keys if info.get(key) is not None}, "config": "config.toml"}]


def _tokens_after(step: int, segments: list[dict]) -> float:
    """Tokens trained on after ``step``: each segment's tokens per step over its steps up to ``step`` (the first
    segment's also before it: a run resumed in a new folder from another run's checkpoint)."""
    tokens, upto = 0.0, 0
    for segment, following in zip(segments, [*segments[1:], None]):
        end = step if following is None else min(step, following["first_step"] - 1)
        if end > upto:
            tokens += segment["tokens_per_step"] * (end - upto)
            upto = end
    return tokens


def _tokens_per_step_from_config(path: Path) -> int | None:
    from meshtron.config import load_config
    from meshtron.errors import MeshtronError

    if not (path / "config.toml").is_file():
        return None
    try:
        cfg = load_config(path / "config.toml", env={})
    except MeshtronError:  # a config this version no longer reads: plot against steps only
        return None
    return cfg.train.global_batch_size * cfg.data.seq_len


NUMBERS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "mfu",
    "max_memory_gb",
    "eval_loss",
    "eval_perplexity",
    "rewards/accuracies",
)
"""The columns of a metrics row that ``meshtron plot`` and ``compare`` read: each a number when present."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _row_problem(row: dict) -> str | None:
    """Why a metrics row (one with a step and a loss) cannot be plotted, in a few words, or None."""
    step = row["step"]
    if not (_is_number(step) and float(step).is_integer()):
        return f"its step is {step!r}, not a whole number"
    for key in NUMBERS:
        if row.get(key) is not None and not _is_number(row[key]):
            return f"its {key} is {row[key]!r}, not a number"
    return None


def _read_info(path: Path) -> dict:
    """run.json as a dict ({} when there is none)."""
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); remove it to plot the run without its layout") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{path} is not a JSON object; remove it to plot the run without its layout")
    if info.get("tokens_per_step") is not None and not _is_number(info["tokens_per_step"]):
        raise ConfigError(f"{path}: tokens_per_step is {info['tokens_per_step']!r}, not a number; remove the file")
    segments = info.get("segments", [])
    if not (
        isinstance(segments, list)
        and all(_is_segment(segment) for segment in segments)
        and [segment["first_step"] for segment in segments] == sorted({segment["first_step"] for segment in segments})
    ):
        raise ConfigError(
            f"{path}: segments is not a list of {{first_step, layout, ...}} objects in step order; remove the file "
            "to plot the run without its layout"
        )
    return info


def _is_segment(segment) -> bool:
    if not (isinstance(segment, dict) and _is_number(segment.get("first_step"))):
        return False
    return segment.get("tokens_per_step") is None or _is_number(segment["tokens_per_step"])


def read_run(path: str | Path) -> Run:
    """The run in ``path`` (a ``run.output_dir``); a one-line error when it has no metrics."""
    path = Path(path)
    metrics = path / METRICS
    if not metrics.is_file():
        raise ConfigError(f"'{path}' has no {METRICS}; give the run.output_dir of a meshtron run")
    try:
        text = metrics.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{metrics} is unreadable ({err}); is it a meshtron metrics file?") from None
    by_step: dict[int, dict] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{metrics}:{number} is not a JSON row; is it a meshtron metrics file?") from None
        if isinstance(row, dict) and "step" in row and "loss" in row:
            problem = _row_problem(row)
            if problem is not None:
                raise ConfigError(f"{metrics}:{number}: {problem}; is it a meshtron metrics file?")
            by_step[int(row["step"])] = row
    if not by_step:
        raise ConfigError(f"{metrics} has no logged steps yet")
    info = _read_info(path / RUN_INFO)
    if "tokens_per_step" not in info:
        info["tokens_per_step"] = _tokens_per_step_from_config(path)
    return Run(path, [by_step[step] for step in sorted(by_step)], info)
