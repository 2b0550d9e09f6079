"""Planned vs measured in every GPU run (meshtron.train.run.planned, meshtron.plan.for_run): the rows of metrics.jsonl
carry the planner's figures from the first steady step and the log words the comparison once; the figures are the
planner's own for the run's layout, settings and pipeline position."""

from __future__ import annotations

import json
import re

import pytest
import torch

from meshtron.config import load_config
from meshtron.distributed.runtime import Runtime
from meshtron.models.presets import make_preset_config
from meshtron.plan import for_run
from meshtron.plan.layout import Layout, Workload
from meshtron.plan.memory import memory_per_pipeline_rank
from meshtron.plan.model_shape import ModelShape
from meshtron.plan.throughput import estimate_step
from meshtron.train.run.planned import STEADY_STEP, PlannedFigures, PlannedVsMeasured
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_the_rows_carry_the_planned_figures_from_the_steady_step(tmp_path, cache_dir, capsys):
    cfg = load_config(
        None,
        [
            "model.preset=llama-tiny",
            "data.seq_len=16",
            "data.max_documents=20",
            f"data.cache_dir={cache_dir}",
            "train.steps=4",
            "train.global_batch_size=2",
            f"run.output_dir={tmp_path / 'run'}",
            "run.progress=false",
        ],
        env={},
    )
    planned = PlannedFigures(peak_gb=1.5, step_s=0.25, hardware="a test GPU")
    train(cfg, CPU_RUNTIME, planned=planned)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["step_s"] > 0 for row in rows)
    for row in rows:
        planned_fields = {key: row[key] for key in ("planned_peak_gb", "planned_step_s") if key in row}
        expected = {} if row["step"] < STEADY_STEP else {"planned_peak_gb": 1.5, "planned_step_s": 0.25}
        assert planned_fields == expected, row
    lines = [line for line in capsys.readouterr().out.splitlines() if "planned vs measured" in line]
    assert len(lines) == 1 and "at step 3" in lines[0] and "0.250 planned" in lines[0], lines
    measured = float(re.search(r"step ([0-9.]+) s measured", lines[0])[1])
    assert measured == pytest.approx(rows[2]["step_s"], abs=1e-3)  # the row's time, rounded to 4 and 3 places


def test_the_comparison_counts_from_the_start_of_a_resumed_run():
    compared = PlannedVsMeasured(PlannedFigures(peak_gb=10.0, step_s=None, hardware="NVIDIA L4"), start_step=100)
    assert compared.fields(102) == {} and compared.message(102, 9.0, 1.0) is None
    assert compared.fields(103) == {"planned_peak_gb": 10.0}  # no step time for a GPU the planner does not model
    line = compared.message(103, 8.0, 1.0)
    assert "planner +25.0%" in line and "NVIDIA L4 is not a GPU the planner models" in line
    assert compared.message(104, 8.0, 1.0) is None  # once
    assert PlannedVsMeasured(None, 0).fields(5) == {} and PlannedVsMeasured(None, 0).message(5, 1.0, 1.0) is None


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA L4", None),
    ],
)
def test_the_planners_name_of_a_gpu(name, key):
    assert for_run.gpu_key(name) == key


def test_a_gpu_run_gets_the_planners_figures_for_its_own_pipeline_position(monkeypatch):
    """Two pipeline stages of llama-1b on an H100 (asked of the planner on a CPU machine): each rank's planned peak is
    its own stage's total, the step time the planner's step for that layout and these settings."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cfg = load_config(
        None,
        [
            "model.preset=llama-1b",
            "data.seq_len=2048",
            "train.global_batch_size=8",
            "parallel.pp=2",
            "train.micro_batch_size=2",
            "model.dtype=float32",
            "precision.mixed_precision=bf16",
        ],
        env={},
    )
    hf_config = make_preset_config("llama-1b", 259)
    cuda = torch.device("cuda", 0)
    shape = ModelShape.from_hf_config(hf_config, cfg.model, cfg.lora)
    layout, workload = Layout.from_config(cfg, 2, hf_config), Workload.from_config(cfg, "cuda")
    stages = memory_per_pipeline_rank(shape, layout, workload)
    step = estimate_step(shape, layout, workload, for_run.GPUS["h100"], hf_config)
    first, last = (for_run.planned_figures(cfg, 2, rank, cuda, hf_config) for rank in (0, 1))
    assert first.peak_gb == pytest.approx(stages[0].total / 2**30)
    assert last.peak_gb == pytest.approx(stages[1].total / 2**30)
    assert first.peak_gb != last.peak_gb  # the embeddings on one stage, the head and loss on the other
    assert first.step_s == pytest.approx(step.seconds) and "H100" in first.hardware
    assert for_run.planned_figures(cfg, 2, 0, torch.device("cpu"), hf_config) is None  # CPU memory is RSS


def test_a_run_the_planner_cannot_model_still_trains(monkeypatch, capsys):
    from meshtron import worker

    def refuse(*args):
        raise ValueError("an anatomy the planner does not know")

    monkeypatch.setattr(for_run, "planned_figures", refuse)
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0))
    assert worker._planned_figures(None, runtime, setup=type("RunSetup", (), {"hf_config": None})()) is None
    said = capsys.readouterr().out
    assert "no planned figures for this run (ValueError: an anatomy the planner does not know)" in said
