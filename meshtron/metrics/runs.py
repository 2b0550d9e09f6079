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
    """run.json: layout, world_size, family, tokens_per_step (empty for runs older than run.json)."""

    @property
    def label(self) -> str:
        layout = self.info.get("layout")
        return f"{self.path.name} ({layout})" if layout else self.path.name

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
        """Tokens trained on after each step (global batch x sequence length x step), when known."""
        per_step = self.info.get("tokens_per_step")
        return [per_step * step for step in self.steps] if per_step else None


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


NUMBERS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "max_memory_gb", "eval_loss", "eval_perplexity")
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
    return info


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
