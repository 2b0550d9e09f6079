"""``bench/distill_memory.py`` at a tiny case: it runs, measures both paths in fresh processes and prints its table
(the figures for BENCHMARKS.md come from its default cases, not from here)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, worker_env


def test_distill_memory_bench_measures_both_paths(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, "bench/distill_memory.py", "--tokens", "256", "--vocab", "4096", "--hidden", "32"]
    command += ["--teacher-hidden", "48", "--chunk-size", "32", "--json", str(out)]
    proc = subprocess.run(command, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = json.loads(out.read_text())
    assert (row["tokens"], row["vocab"], row["chunk_size"]) == (256, 4096, 32)
    logits = 256 * 4096 * 4
    # The unfused path holds several whole float32 logits at once; the fused one a few chunks' (1/8 of them each).
    assert row["unfused_bytes"] > 2 * logits and row["fused_bytes"] < row["unfused_bytes"] / 2, row
    assert "| 256 | 4096 |" in proc.stdout
