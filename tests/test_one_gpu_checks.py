"""The standing one-GPU queue (bench/one_gpu_checks/gpu_queue.py): it runs on a CPU (the CUDA checks skip with a
reason, the CPU-capable ones run small and pass), a failing, crashing or slow check is reported as failed with its
reason, the registry and README.md's "never run" rows stay in step, and the results land between BENCHMARKS.md's
markers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "one_gpu_checks"))

import gpu_queue  # noqa: E402
from gpu_queue import BEGIN, CHECKS, END, NOT_THE_QUEUES, Check, coverage_problems  # noqa: E402

README = (ROOT / "README.md").read_text()


def test_the_queue_runs_on_a_cpu_with_its_cuda_checks_skipped(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the queue itself (python bench/one_gpu_checks/gpu_queue.py)")
    monkeypatch.delenv("GPU_QUEUE_ON_CPU", raising=False)
    lines = []
    results = gpu_queue.run_queue(CHECKS, tmp_path / "out", tmp_path / "results.json", report=lines.append)
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(results, default=str))
    assert results["device"] == "cpu" and results["torch"] == torch.__version__ and results["date"]
    by_name = {row["name"]: row for row in results["checks"]}
    assert list(by_name) == [check.name for check in CHECKS]
    for check in CHECKS:
        row = by_name[check.name]
        if check.cuda:
            assert (row["status"], row["reason"]) == ("skip", "needs a CUDA GPU"), row
        else:
            assert row["status"] == "pass" and row["figures"], row
    assert len(lines) == len(CHECKS) + 1 and "'pass': 2" in lines[-1]


FAKES = """
import time
from gpu_support import Skip

def passes(out):
    return {"answer": 42.0}

def fails(out):
    assert 1 + 1 == 3, "arithmetic is off"

def crashes(out):
    raise RuntimeError("CUDA error: an illegal memory access")

def skips(out):
    raise Skip("needs torchao")

def hangs(out):
    time.sleep(60)
"""


def test_each_outcome_of_a_check_is_reported_with_its_reason(tmp_path, monkeypatch):
    fakes = tmp_path / "fakes.py"
    fakes.write_text(FAKES)
    monkeypatch.setattr(gpu_queue, "cuda_available", lambda: True)
    checks = [
        Check(name, f"{fakes}:{name}", estimate_s=1, limit_s=limit)
        for name, limit in (("passes", 30), ("fails", 30), ("crashes", 30), ("skips", 30), ("hangs", 3))
    ]
    results = gpu_queue.run_queue(checks, tmp_path / "out", tmp_path / "r.json", budget_s=120, report=lambda _: None)
    got = {row["name"]: (row["status"], row["reason"], row["figures"]) for row in results["checks"]}
    assert got["passes"] == ("pass", "", {"answer": 42.0})
    assert got["fails"] == ("fail", "arithmetic is off", {})
    assert got["crashes"][0] == "fail" and got["crashes"][1].startswith("RuntimeError: CUDA error: an illegal")
    assert got["skips"] == ("skip", "needs torchao", {})
    assert got["hangs"][:2] == ("fail", f"timed out after 3 s (log: {tmp_path / 'out' / 'hangs' / 'log.txt'})")
    late = Check("late", f"{fakes}:passes", estimate_s=500, limit_s=600)
    row = gpu_queue.run_queue([late], tmp_path / "out", tmp_path / "r.json", budget_s=60, report=lambda _: None)
    assert row["checks"][0]["status"] == "skip" and "budget" in row["checks"][0]["reason"]


def test_every_never_run_row_of_the_readme_has_a_check_or_is_marked_beyond_one_gpu():
    assert coverage_problems(README) == []


def test_a_new_never_run_row_without_a_check_fails_the_coverage():
    table_end = README.index("\n", README.index("| Faults:"))
    added = (
        README[:table_end]
        + "\n| Quantum attention (`model.qubits`) | done on CPU; **never run on a GPU** |"
        + README[table_end:]
    )
    problems = coverage_problems(added)
    assert len(problems) == 1 and "'Quantum attention (`model.qubits`)' says 'never run'" in problems[0], problems


def test_a_check_or_mark_naming_a_row_that_is_gone_fails_the_coverage():
    stale = (*CHECKS, Check("gone", "gpu_kernels:fused_loss", 1, 1, rows=("Pipelined quantum annealing",)))
    problems = coverage_problems(README, stale)
    assert problems == [
        "check gone names README row 'Pipelined quantum annealing', which matches 0 rows of the status table"
    ]
    problems = coverage_problems(README, CHECKS, {**NOT_THE_QUEUES, "Holographic storage": "needs a hologram"})
    assert len(problems) == 1 and "NOT_THE_QUEUES names README row 'Holographic storage'" in problems[0]


def test_the_results_are_written_between_the_benchmarks_markers(tmp_path):
    checks = [Check(name, "m:f", 1, 1) for name in ("alpha", "beta", "gamma", "delta")]
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(
        f"# Benchmarks\nbefore\n{BEGIN}\n| check | result |\n| `gamma` | pass | x 1 | 2026-01-01 | H100 | 2.11 |\n"
        f"| `delta` | pass | old | 2026-01-01 | H100 | 2.11 |\n{END}\nafter\n"
    )
    results = {"device": "NVIDIA H200", "torch": "2.11.0", "date": "2026-11-28 01:00 UTC", "checks": [
        {"name": "alpha", "status": "pass", "reason": "", "figures": {"ratio": 1.0234, "losses": [5.1, 5.0]}},
        {"name": "beta", "status": "fail", "reason": "host bytes: x4.2 | outside", "figures": {}},
        {"name": "gamma", "status": "skip", "reason": "budget", "figures": {}},
        {"name": "delta", "status": "pass", "reason": "", "figures": {"peak_gib": 3.5}},
    ]}  # fmt: skip
    gpu_queue.write_benchmarks(results, page, checks)
    text = page.read_text()
    assert text.startswith(f"# Benchmarks\nbefore\n{BEGIN}\n") and text.endswith(f"{END}\nafter\n")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `alpha` | pass | ratio 1.02; losses [5.1, 5] | 2026-11-28 01:00 UTC | NVIDIA H200 | 2.11.0 |",
        "| `beta` | fail | host bytes: x4.2 / outside | 2026-11-28 01:00 UTC | NVIDIA H200 | 2.11.0 |",
        "| `gamma` | pass | x 1 | 2026-01-01 | H100 | 2.11 |",  # skipped this time: its last result stays
        "| `delta` | pass | peak_gib 3.5 | 2026-11-28 01:00 UTC | NVIDIA H200 | 2.11.0 |",
    ]
    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        gpu_queue.write_benchmarks(results, page, checks)


def test_benchmarks_md_has_the_queues_section_with_a_row_per_check():
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    names = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
    assert names == [check.name for check in CHECKS]


@pytest.mark.parametrize("cuda", [True, False])
def test_no_check_starts_with_less_of_the_budget_left_than_its_estimate(tmp_path, monkeypatch, cuda):
    """The first GPU run started fused_loss (a check that also runs on a CPU) with 1 s of the budget left, and failed
    it as timed out: every check that would run is skipped instead; one whose limit the budget cuts says so."""
    fakes = tmp_path / "fakes.py"
    fakes.write_text(FAKES)
    monkeypatch.setattr(gpu_queue, "cuda_available", lambda: True)
    late = Check("late", f"{fakes}:passes", estimate_s=500, limit_s=600, cuda=cuda)
    row = gpu_queue.run_queue([late], tmp_path / "out", tmp_path / "r.json", budget_s=60, report=lambda _: None)
    assert row["checks"][0]["status"] == "skip" and "60 s of the queue's budget left" in row["checks"][0]["reason"]
    slow = Check("hangs", f"{fakes}:hangs", estimate_s=1, limit_s=30, cuda=cuda)
    row = gpu_queue.run_queue([slow], tmp_path / "out", tmp_path / "r.json", budget_s=3, report=lambda _: None)
    assert row["checks"][0]["reason"].startswith("timed out after 3 s (the queue's budget left; its limit is 30 s)")


def test_the_distill_check_comes_right_after_the_dpo_one():
    """The queue's ``distill`` check (issue 60) runs right after ``preference_dpo``. (Its CPU half, a minute with
    compiled blocks, is run by hand before a GPU session: ``GPU_QUEUE_ON_CPU=1 python bench/one_gpu_checks/gpu_queue.py
    --only distill``; it passed on 2026-11-28.)"""
    names = [check.name for check in CHECKS]
    assert names.index("distill") == names.index("preference_dpo") + 1
