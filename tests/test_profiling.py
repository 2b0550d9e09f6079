"""Profiling (docs/profiling.md): the trace file, the summary by category, and its accounting. The 2-process trace
per rank is checked in test_train.py's self-launch test."""

from __future__ import annotations

import collections
import json
import re
from types import SimpleNamespace

import pytest
import torch

from meshtron.config import load_config, parse_step_range
from meshtron.errors import ConfigError
from meshtron.metrics.profiling import CATEGORIES, category, summarize
from meshtron.train.runtime import Runtime
from meshtron.train.trainer import train


@pytest.mark.parametrize(
    "name, expected",
    [
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("aten::_grouped_mm", "matmul"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("flash_fwd_kernel", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("c10d::allgather_", "communication"),
        ("Optimizer.step#AdamW.step", "optimizer"),
        ("aten::_foreach_mul_", "optimizer"),
        ("aten::copy_", "copies"),
        ("Memcpy HtoD (Pageable -> Device)", "copies"),
        ("aten::cat", "copies"),
        ("aten::silu", "other"),
        ("MmBackward0", "other"),  # the autograd node's own overhead; its aten::mm child is the matmul
    ],
)
def test_category_of_an_operator_or_kernel(name, expected):
    assert category(name) == expected


def event(name: str, own_us: float, parent=None):
    return SimpleNamespace(name=name, self_cpu_time_total=own_us, cpu_parent=parent, kernels=[])


def test_summary_counts_each_operator_once_in_its_outermost_enclosing_category():
    attention = event("aten::scaled_dot_product_attention", 5.0)
    step = event("Optimizer.step#AdamW.step", 1.0)
    events = [
        attention,
        event("aten::bmm", 20.0, attention),  # SDPA's own matmul on CPU: attention's time
        event("aten::mm", 30.0),
        step,
        event("aten::_foreach_add_", 4.0, step),
        event("aten::copy_", 2.0, event("c10d::allreduce_", 3.0)),  # a copy inside a collective
        event("aten::silu", 7.0),
    ]
    summary = summarize(events, "cpu")
    assert summary.times_us == {
        "matmul": 30.0,
        "attention": 25.0,
        "communication": 2.0,  # the allreduce itself is not in the list, only its copy
        "optimizer": 5.0,
        "copies": 0.0,
        "other": 7.0,
    }
    assert summary.total_us == 69.0


@pytest.mark.parametrize("value", ["0-2", "3-2", "a-b", "2-", "1,2"])
def test_a_bad_step_range_is_a_one_line_error(value):
    with pytest.raises(ConfigError, match=f"run.profile_steps: '{value}' is not a range of steps"):
        parse_step_range("run.profile_steps", value)
    assert parse_step_range("run.profile_steps", "4") == (4, 4) and parse_step_range("x", " 2 - 5 ") == (2, 5)
    with pytest.raises(ConfigError, match="goes past the last step"):
        load_config(None, ["train.steps=4", "run.memory_snapshot_steps=3-5"], env={})


def top_level_microseconds(trace: dict) -> float:
    """The summed duration of the trace's outermost operators (those inside no other one on their thread)."""
    by_thread = collections.defaultdict(list)
    for item in trace["traceEvents"]:
        if item.get("ph") == "X" and item.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(item["pid"], item["tid"])].append(item)
    total = 0.0
    for items in by_thread.values():
        end = -1.0
        for item in sorted(items, key=lambda i: (i["ts"], -i["dur"])):
            if item["ts"] >= end:
                total += item["dur"]
                end = item["ts"] + item["dur"]
    return total


def test_profiled_steps_give_a_trace_and_a_summary_of_all_its_time(tmp_path, capsys):
    """Steps 2-3 of 3: profile/rank-0.json is a Chrome trace holding matmuls and the optimizer step; the summary's
    categories add up to its total, which is the trace's outermost operators' time; a memory snapshot on CPU is one
    line and nothing else."""
    cfg = load_config(
        None,
        [
            "model.preset=llama-tiny",
            "data.max_documents=20",
            "data.seq_len=32",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=3",
            "train.global_batch_size=4",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'run'}",
            "run.profile_steps=2-3",
            "run.memory_snapshot_steps=1-2",
        ],
        env={},
    )
    train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    out = capsys.readouterr().out
    trace = json.loads((tmp_path / "run" / "profile" / "rank-0.json").read_text())
    names = {item.get("name") for item in trace["traceEvents"]}
    assert "aten::mm" in names and any(str(name).startswith("Optimizer.step") for name in names)
    rows = dict(re.findall(r"^  (\w+)\s+([\d.]+) ms", out, re.MULTILINE))
    assert set(rows) == {*CATEGORIES, "total"}, out
    parts = sum(float(rows[name]) for name in CATEGORIES)
    assert parts == pytest.approx(float(rows["total"]), abs=0.01)
    assert float(rows["matmul"]) > 0 and float(rows["optimizer"]) > 0 and float(rows["communication"]) == 0
    assert float(rows["total"]) * 1e3 == pytest.approx(top_level_microseconds(trace), rel=1e-3)
    assert "profile of steps 2-3 on rank 0" in out
    assert "CUDA memory snapshots need a GPU; this run is on cpu, nothing recorded" in out
    assert not (tmp_path / "run" / "memory").exists()
