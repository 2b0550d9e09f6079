"""Per-step metrics: ``metrics.jsonl`` on rank 0 (and the experiment trackers ``run.loggers`` names) and a live
progress line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO

from meshtron.metrics.runs import METRICS, RUN_INFO


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
    ):
        self.enabled = enabled
        self.trackers = trackers or []  # TensorBoard, W&B (meshtron.metrics.trackers): get every row too
        self.total_steps = total_steps
        self.progress = progress and enabled
        self.stream = stream or sys.stdout  # looked up now: sys.stdout may have been replaced since import
        self.live = self.progress and self.stream.isatty()
        self.start = time.perf_counter()
        self.output_dir = Path(output_dir) if output_dir else None
        self._file = open(output_dir / METRICS, "a") if enabled and output_dir else None

    def describe_run(self, info: dict) -> None:
        """Write ``run.json`` beside metrics.jsonl: the layout and sizes that ``meshtron plot`` / ``compare`` show."""
        if self.enabled and self.output_dir is not None:
            (self.output_dir / RUN_INFO).write_text(json.dumps(info, indent=1))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"elapsed_s": round(time.perf_counter() - self.start, 3), "time": round(time.time(), 3), **record}
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for tracker in self.trackers:
            tracker.log(record)
        if self.progress:
            self._print_progress(record)

    def _print_progress(self, r: dict) -> None:
        if "loss" not in r:  # an evaluation without training (meshtron eval): its result is printed at the end
            return
        mfu = f" | mfu {r['mfu']:.1%}" if r.get("mfu") is not None else ""
        aux = f" (aux {r['aux_loss']:.4f}, expert load {r['expert_load_max']:.2f}x)" if "aux_loss" in r else ""
        line = (
            f"step {r['step']:>{len(str(self.total_steps))}}/{self.total_steps} | loss {r['loss']:.4f}{aux} | "
            f"grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s{mfu} | "
            f"mem {r['max_memory_gb']:.2f} GB | {r['elapsed_s']:.0f}s"
        )
        if "eval_loss" in r:
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
