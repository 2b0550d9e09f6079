"""``meshtron check``: the layouts it runs for N processes, its comparison, and the command itself on 2 CPU processes
(every layout matches one process; a deliberately broken layout makes it fail)."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_main

import meshtron.check.layouts as check_layouts
from meshtron.check.compare import CPU, compare
from meshtron.check.layouts import CheckCase, base_overrides, candidate_degrees, layouts_for, write_pairs
from meshtron.check.worker import BREAK_ENV

TWO_PROCESS_LAYOUTS = ["ddp2", "fsdp2", "tp2", "cp2_ring", "cp2_ulysses", "pp2", "ep2", "dpo_tp2", "distill_tp2"]


def test_two_processes_run_each_parallelism_alone():
    assert all(isinstance(row, CheckCase) for row in layouts_for(2, "cpu"))
    assert not hasattr(check_layouts, "Layout")  # the planner's Layout is the only one (issue 58)
    assert [layout.name for layout in layouts_for(2, "cpu")] == TWO_PROCESS_LAYOUTS
    assert {layout.reference.key for layout in layouts_for(2, "cpu")} == {
        "1proc-llama-tiny-cpu",
        "1proc-qwen3moe-tiny-cpu",
        "1proc-dpo-llama-tiny-cpu",
        "1proc-distill-llama-tiny-cpu",
    }


def test_more_processes_add_combinations_up_to_4_d():
    """4 ranks add HSDP and the 2-D layouts; 8 the 3-D ones; 16 a 4-D one. Every layout uses all N ranks."""
    four = {layout.name for layout in layouts_for(4, "cpu")}
    assert {"hsdp2x2", "fsdp2_tp2", "cp2_tp2_ring", "pp2_tp2", "pp2_fsdp2", "ep2_tp2", "pp4", "tp4"} <= four
    assert "dpo_fsdp2_tp2" in four and [row.name for row in layouts_for(3, "cpu")][-2] == "dpo_fsdp3"
    for n in (4, 8, 16):
        dims = [
            sum(d > 1 for d in (x.dp_replicate * x.dp_shard, x.tp, x.cp, x.pp))
            for x in (c.dims for c in candidate_degrees(n))
        ]
        assert max(dims) == {4: 2, 8: 3, 16: 4}[n], n
        for degrees in (c.dims for c in candidate_degrees(n)):
            assert degrees.dp_replicate * degrees.dp_shard * degrees.tp * degrees.cp * degrees.pp == n


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 16])
def test_every_layout_passes_preflight(n, tmp_path):
    """meshtron's own checks accept every run check would start (the tiny models' heads, layers, experts,
    sequence length and batch divide as each layout needs), and so does the one-process reference."""
    from meshtron.config import load_config
    from meshtron.train.setup.preflight import preflight

    pairs = write_pairs(tmp_path / "pairs.jsonl")
    for layout in layouts_for(n, "cpu"):
        for run in (layout.run, layout.reference):
            settings = base_overrides(n, 3, str(tmp_path)) + [f"model.preset={run.model}", *run.overrides]
            settings += [f"data.path={pairs}"] if run.pairs else []
            preflight(load_config(None, settings, env={}), run.world, "cpu")


def test_on_gpus_each_layout_is_compared_with_one_gpu_and_one_gpu_with_the_cpu():
    """The CUDA rows (CPU-visible logic): one GPU against the CPU's run first (the device's kernels), then every
    layout against a one-GPU run; with one GPU only the first."""
    rows = layouts_for(2, "cuda")
    assert rows[0].name == "1gpu_vs_cpu" and (rows[0].run.device, rows[0].reference.device) == ("cuda", "cpu")
    assert all(row.run.device == row.reference.device == "cuda" for row in rows[1:])
    assert [row.name for row in rows[1:]] == TWO_PROCESS_LAYOUTS
    assert [row.name for row in layouts_for(1, "cuda")] == ["1gpu_vs_cpu"]


def _result(scale_norm: float = 1.0, nudge: float = 0.0, drop: str | None = None, nan: bool = False) -> dict:
    state = {"a.weight": torch.linspace(-1, 1, 64).view(8, 8), "b.bias": torch.linspace(0.5, 1, 8)}
    state = {k: v.clone() for k, v in state.items() if k != drop}
    state["a.weight"][3, 4] += nudge
    if nan:
        state["b.bias"][0] = math.nan
    return {"losses": [5.0, 4.5, 4.0], "grad_norms": [2.0 * scale_norm, 1.5, 1.0], "state": state}


def test_compare_passes_rounding_and_names_each_kind_of_difference():
    reference = _result()
    assert compare([_result(), _result(nudge=1e-7)], reference, CPU).passed
    assert compare([_result(), _result(scale_norm=2.0)], reference, CPU).problems == ["gradient norms"]
    nudged = compare([_result(nudge=1e-2)], reference, CPU)
    assert nudged.problems == ["weights"] and nudged.weight_max_abs == pytest.approx(1e-2, rel=1e-3)
    assert compare([_result(drop="b.bias")], reference, CPU).problems == ["no rank holds b.bias"]
    assert "weights" in compare([_result(nan=True)], reference, CPU).problems
    short = dict(_result(), losses=[5.0, 4.5])
    assert compare([short], reference, CPU).problems == ["rank 0 trained 2 steps, one process 3"]


def test_check_refuses_bad_requests_before_starting_anything(monkeypatch):
    unknown = run_main(["check", "--nproc", "2", "--only", "tp3"])
    assert unknown.returncode == 2 and "--only: no layout tp3" in unknown.stderr and "cp2_ulysses" in unknown.stderr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    too_many = run_main(["check", "--nproc", "4"])
    assert too_many.returncode == 2 and "--nproc 4 but 2 GPU(s) visible" in too_many.stderr
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "without torchrun" in run_main(["check"]).stderr


ROW = re.compile(r"^(\S+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(pass|FAIL|ERROR)\s+([\d.]+)")


def _rows(stdout: str) -> dict[str, tuple]:
    return {m.group(1): m.groups()[1:] for line in stdout.splitlines() if (m := ROW.match(line))}


@pytest.mark.slow
def test_check_on_2_cpu_processes_matches_one_process():
    """The CI run: `meshtron check --nproc 2` on CPU (gloo) passes, with every layout's row and the environment."""
    done = run_main(["check", "--nproc", "2"])
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert list(rows) == TWO_PROCESS_LAYOUTS
    assert all(row[5] == "pass" and row[0] == "2" for row in rows.values())
    # Differences are rounding, not zero everywhere: the layouts did split the work (TP's matmuls, CP's attention).
    assert float(rows["tp2"][3]) > 0 and float(rows["cp2_ring"][3]) > 0
    assert "backend gloo on CPU" in done.stdout and f"torch {torch.__version__}" in done.stdout
    assert "all 9 layouts match one process" in done.stdout


@pytest.mark.slow
def test_a_broken_layout_fails_the_check(monkeypatch):
    """MESHTRON_CHECK_BREAK=fsdp2 scales one rank's linear outputs by 1.01: the row says FAIL and the exit status
    is 1, while a layout that is not broken still passes beside it."""
    monkeypatch.setenv(BREAK_ENV, "fsdp2")
    done = run_main(["check", "--nproc", "2", "--only", "fsdp2,ddp2", "--steps", "2"])
    print(done.stdout)
    assert done.returncode == 1
    rows = _rows(done.stdout)
    assert rows["fsdp2"][5] == "FAIL" and rows["ddp2"][5] == "pass"
    assert "1 of 2 layouts differ: fsdp2 (losses, gradient norms, weights)" in done.stdout
    kept = re.search(r"kept in (\S+)", done.stdout).group(1)
    shutil.rmtree(kept)


@pytest.mark.slow
def test_the_dpo_row_trains_dpo_with_a_reference_and_fails_when_broken(monkeypatch):
    """The DPO row (DPO, a frozen-copy reference, the check's pairs) fails when one rank's linear outputs are off by
    1% (MESHTRON_CHECK_BREAK=dpo_tp2), and its ranks trained DPO with the reference."""
    monkeypatch.setenv(BREAK_ENV, "dpo_tp2")
    done = run_main(["check", "--nproc", "2", "--only", "dpo_tp2", "--steps", "2"])
    print(done.stdout)
    assert done.returncode == 1 and _rows(done.stdout)["dpo_tp2"][5] == "FAIL"
    assert "1 of 1 layouts differ: dpo_tp2" in done.stdout
    kept = re.search(r"kept in (\S+)", done.stdout).group(1)
    logs = " ".join(log.read_text() for log in Path(kept).glob("dpo_tp2/rank*.log"))
    shutil.rmtree(kept)
    assert "DPO (beta 0.1" in logs and "reference: a frozen copy" in logs, logs[-2000:]


def test_the_distillation_row_has_a_teacher_of_another_shape_under_tp_fsdp_and_pp():
    """The distillation row: a teacher of another shape than the student (its own shards and pipeline split) under
    tensor parallelism with FSDP (4 ranks and more) and a pipeline too (8 and 16), against one process distilling."""
    from meshtron.models.presets import PRESETS

    rows = {n: layouts_for(n, "cpu")[-1] for n in (2, 3, 4, 8, 16)}
    assert [row.name for row in rows.values()] == [
        "distill_tp2",
        "distill_fsdp3",
        "distill_fsdp2_tp2",
        "distill_pp2_fsdp2_tp2",
        "distill_pp2_fsdp4_tp2",
    ]
    teacher, student = PRESETS[check_layouts.DISTILL_TEACHER], PRESETS[check_layouts.DENSE]
    assert all(teacher[key] != student[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
    for row in rows.values():
        assert row.run.model == row.reference.model == check_layouts.DENSE
        assert "train.objective=distill" in row.run.overrides and row.reference.key == "1proc-distill-llama-tiny-cpu"
        assert set(check_layouts.DISTILL_OVERRIDES) <= set(row.reference.overrides) and row.reference.world == 1


@pytest.mark.slow
def test_the_distillation_row_distills_from_the_teacher_and_fails_when_broken(monkeypatch):
    """The distillation row fails when one rank's linear outputs (the student's and the teacher's) are off by 1%
    (MESHTRON_CHECK_BREAK=distill_tp2), and its ranks distilled from the teacher."""
    monkeypatch.setenv(BREAK_ENV, "distill_tp2")
    done = run_main(["check", "--nproc", "2", "--only", "distill_tp2", "--steps", "2"])
    print(done.stdout)
    assert done.returncode == 1 and _rows(done.stdout)["distill_tp2"][5] == "FAIL"
    assert "1 of 1 layouts differ: distill_tp2" in done.stdout
    kept = re.search(r"kept in (\S+)", done.stdout).group(1)
    logs = " ".join(log.read_text() for log in Path(kept).glob("distill_tp2/rank*.log"))
    shutil.rmtree(kept)
    assert "distill from llama-small (4 layers, hidden 192" in logs, logs[-2000:]


def test_gpu_ranks_start_as_fresh_interpreters_when_the_forkserver_initialized_cuda(monkeypatch, tmp_path, capsys):
    """A child forked after CUDA was initialized cannot use it: when the probe (tested in test_command_line.py) says
    the forkserver did, the GPU runs' ranks are spawned instead, with one line; CPU runs keep the forkserver."""
    from meshtron.check import runner

    probed = []
    monkeypatch.setattr(runner, "initialized_cuda_before_forking", lambda context: probed.append(context) or True)
    launcher = runner._Launcher(tmp_path, [], None, 60.0)
    assert launcher.context_for("cpu").get_start_method() == "forkserver" and not probed
    assert launcher.context_for("cuda").get_start_method() == "spawn"
    assert launcher.context_for("cuda").get_start_method() == "spawn" and len(probed) == 1
    assert "CUDA was initialized in the forkserver" in capsys.readouterr().err
