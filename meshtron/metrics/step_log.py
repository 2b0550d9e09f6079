"""Per-step metrics: ``metrics.jsonl`` on rank 0 (and the experiment trackers ``run.loggers`` names) and a live
progress line with an estimate of the time left."""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import IO

from meshtron.metrics.runs import METRICS


def format_duration(seconds: float) -> str:
    """A duration as the progress line shows it: ``45s``, ``3m12s``, ``2h05m``, ``3d04h``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


class Eta:
    """The time left to ``total_steps`` from the measured time per step: the wall time between the last logged rows
    (up to ``window`` of them, so evaluations and saves count as they recur, and a change of speed shows within a
    window). None before a start's second row: its first step's time holds the warm-up (compilation, CUDA's start,
    the first data), which on one H100 made step 1 of a 30-step run say "eta 8m39s" for a run that ended 1 s later."""

    def __init__(self, total_steps: int, window: int = 20):
        self.total_steps = total_steps
        self.marks: deque[tuple[int, float]] = deque(maxlen=window)

    def update(self, step: int, now: float) -> float | None:
        """Seconds left after ``step`` (logged at time ``now``), or None when there is nothing to go on yet."""
        if self.marks and step <= self.marks[-1][0]:  # a rollback trains steps again: measure afresh
            self.marks.clear()
        self.marks.append((step, now))
        (first_step, first_time), (last_step, last_time) = self.marks[0], self.marks[-1]
        if last_step == first_step:
            return None
        return (last_time - first_time) / (last_step - first_step) * max(0, self.total_steps - step)


class MetricsLogger:
    """Writes one JSON object per logged step and prints progress; inactive on ranks other than 0."""

    def __init__(
        self,
        output_dir: Path | None,
        total_steps: int,
        *,
        enabled: bool,
        progress: bool,
        stream: IO | None = None,
        trackers: list | None = None,
        log_every: int = 1,
    ):
        self.enabled = enabled
        self.log_every = log_every
        self.logged_steps = 0  # training rows of this start
        self.eta = Eta(total_steps)
        self.trackers = trackers or []  # TensorBoard, W&B (meshtron.metrics.trackers): get every row too
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.stream = stream or sys.stdout  # looked up now: sys.stdout may have been replaced since import
        self.live = self.progress and self.stream.isatty()
        self.start = time.perf_counter()
        self.output_dir = Path(output_dir) if output_dir else None
        self._file = open(output_dir / METRICS, "a") if enabled and output_dir else None

    def due(self, step: int) -> bool:
        """Whether the row of ``step`` (1-based) is logged: every ``run.log_every`` steps, and always step 1, the
        first step of this start (after a resume or restart) and the last step."""
        return step % self.log_every == 0 or step in (1, self.total_steps) or not self.logged_steps

    def log(self, record: dict) -> None:
        """Write a row (and print its progress line)."""
        trained = "tokens_per_s" in record  # a trained step's row (not a rollback's, not an evaluation's alone)
        self.logged_steps += trained  # on every rank: ``due`` answers the same everywhere
        if not self.enabled:
            return
        now = time.perf_counter()
        record = {"elapsed_s": round(now - self.start, 3), "time": round(time.time(), 3), **record}
        left = self.eta.update(record["step"], now) if trained else None
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for tracker in self.trackers:
            tracker.log(record)
        if self.progress:
            self._print_progress(record, left)

    def _print_progress(self, r: dict, eta: float | None) -> None:
        # An evaluation without training (meshtron eval) is printed at the end; a rolled-back step has its own line.
        if "loss" not in r or "tokens_per_s" not in r:
            return
        mfu = f" | mfu {r['mfu']:.1%}" if r.get("mfu") is not None else ""
        aux = f" (aux {r['aux_loss']:.4f}, expert load {r['expert_load_max']:.2f}x)" if "aux_loss" in r else ""
        # A preference objective's share of its pairs ranked right (TRL's rewards/accuracies).
        accuracy = f" (accuracy {r['rewards/accuracies']:.2f})" if "rewards/accuracies" in r else ""
        width = len(str(self.total_steps))
        line = (
            f"step {r['step']:>{width}}/{self.total_steps} | loss {r['loss']:.4f}{aux}{accuracy} | "
            f"grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s{mfu} | "
            f"mem {r['max_memory_gb']:.2f} GB | {r['elapsed_s']:.0f}s"
        )
        if eta is not None and r["step"] < self.total_steps:
            line += f" | eta {format_duration(eta)}"
        if "eval_rewards/accuracies" in r:
            line += f" | eval loss {r['eval_loss']:.4f} (accuracy {r['eval_rewards/accuracies']:.2f})"
        elif "eval_loss" in r:
            line += f" | eval loss {r['eval_loss']:.4f} (perplexity {r['eval_perplexity']:.2f})"
        if self.live:
            self.stream.write("\r\x1b[2K" + line)
            if r["step"] == self.total_steps:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            if self.live:
                self.stream.write("\r\x1b[2K")
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()
        if self._file:
            self._file.close()
            self._file = None
