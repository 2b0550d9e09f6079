"""meshtron plan: the planner's numbers against the real sharding code (dry runs of 8B / 70B shapes at
8 to 512 ranks), its command line, and its emitted configs. The comparison with measured memory of
every parity layout is in test_parity.py (it reuses those runs); bench/dry_run.py times the dry runs."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, worker_env

# (name, world size, rank, layout overrides): FSDP alone, HSDP x TP, PP x FSDP x TP (interleaved, the
# last rank, which holds the head), and a 512-rank 3-D layout of the 70B shape.
DRY_RUNS = [
    ("8b_fsdp8", 8, 0, ["model.preset=llama-8b", "train.global_batch_size=8"]),
    ("8b_hsdp_tp2_16", 16, 5, ["model.preset=llama-8b", "parallel.tp=2", "parallel.dp_replicate=2",
                               "train.global_batch_size=16"]),
    ("70b_pp4_tp8_64_last", 64, 63, ["model.preset=llama-70b", "parallel.tp=8", "parallel.pp=4",
                                      "parallel.pp_schedule=Interleaved1F1B", "train.global_batch_size=16"]),
    ("70b_pp8_tp8_512", 512, 0, ["model.preset=llama-70b", "parallel.tp=8", "parallel.pp=8",
                                 "train.global_batch_size=64"]),
]


def plan_cli(capsys, *args: str):
    """``meshtron plan ARGS`` in this process (transformers is imported once for the whole session):
    (exit status, stdout, stderr)."""
    from meshtron.cli import main

    capsys.readouterr()
    status = main(["plan", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry")
    cases = [{"name": name, "world": world, "rank": rank,
              "overrides": overrides + ["data.seq_len=4096", f"run.output_dir={out / name}"]}
             for name, world, rank, overrides in DRY_RUNS]
    (out / "cases.json").write_text(json.dumps(cases))
    import subprocess

    proc = subprocess.run([sys.executable, "tests/dry_run_worker.py", str(out / "cases.json")], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}


@pytest.mark.parametrize("name", [case[0] for case in DRY_RUNS])
def test_dry_run_agrees_with_planner(name, dry_runs):
    got = dry_runs[name]
    print(f"{name}: dry run {got['params'] / 1e9:.3f} GB parameters vs planner {got['planned_params'] / 1e9:.3f} GB "
          f"in {got['seconds']:.1f} s")
    assert abs(got["params"] - got["planned_params"]) <= 0.05 * got["params"]
    assert got["grads"] == got["params"] and got["optimizer"] == 2 * got["params"]  # AdamW: two moments per weight


def test_plan_ranks_layouts_and_emits_a_config_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    args = ["--model", "llama-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32"]
    status, stdout, stderr = plan_cli(capsys, *args, "--json", "--emit-config", str(out))
    assert status == 0, stderr[-3000:]
    candidates = json.loads(stdout[: stdout.rindex("}") + 1])["candidates"]
    assert candidates[0]["fits"] and candidates[0]["memory_gb"]["total"] <= 80 - 3
    assert any(not c["fits"] for c in candidates), "nothing was rejected: the memory check is vacuous"
    for c in candidates:
        layout = c["layout"]
        assert layout["dp_replicate"] * layout["dp_shard"] * layout["cp"] * layout["tp"] * layout["pp"] == 16
    fitting = [c["tokens_per_s"] for c in candidates if c["fits"]]
    assert candidates[0]["tokens_per_s"] >= 0.98 * max(fitting)

    from meshtron.config import load_config
    from meshtron.distributed.mesh import ParallelDims

    cfg = load_config(out, env={})
    best = candidates[0]["layout"]
    dims = ParallelDims.from_config(cfg.parallel, 16)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == tuple(
        best[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    assert cfg.data.seq_len == 4096 and cfg.train.global_batch_size == 32 and cfg.model.preset == "llama-8b"

    written = out.read_text()
    status, _, stderr = plan_cli(capsys, *args, "--emit-config", str(out))
    assert status == 2 and "already exists" in stderr
    assert out.read_text() == written  # untouched


def test_plan_table_and_errors(capsys):
    status, stdout, stderr = plan_cli(capsys, "--model", "llama-tiny", "--gpus", "4", "--seq-len", "256",
                                      "--global-batch", "8", "--gpu", "a100", "--gpu-memory", "40GB", "--reserved-gb", "2.5")
    assert status == 0, stderr[-2000:]
    assert "\n* " in stdout and "layouts fit in 38 GB" in stdout  # 37.5 GB usable
    status, _, stderr = plan_cli(capsys, "--model", "llama-tiny", "--gpus", "4", "--seq-len", "256",
                                 "--global-batch", "8", "--link-efficiency", "0")
    assert status == 2 and "--link-efficiency must be positive" in stderr
    status, stdout, _ = plan_cli(capsys, "--model", "llama-70b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8")
    assert status == 1 and "nothing fits" in stdout
    status, _, stderr = plan_cli(capsys, "--model", "llama-8b", "--gpus", "8", "--seq-len", "8", "--global-batch", "8",
                                 "--gpu", "v100x")
    assert status == 2 and "--gpu: unknown GPU 'v100x'" in stderr
    status, _, stderr = plan_cli(capsys, "--model", "llama-8b", "--gpus", "12", "--seq-len", "8", "--global-batch", "12")
    assert status == 2 and "whole number of nodes" in stderr
    status, _, stderr = plan_cli(capsys, "--model", "llama-8b", "--gpus", "8", "--seq-len", "16384", "--global-batch", "8")
    assert status == 2 and "max_position_embeddings 8192" in stderr


def test_parameter_split_rules():
    from meshtron.plan.model_shape import ParamSpec

    kv = ParamSpec("k_proj.weight", (256, 1024), "kv_colwise")
    assert kv.local_numel(tp=2, fsdp=1, num_kv_heads=2) == 128 * 1024
    assert kv.local_numel(tp=4, fsdp=1, num_kv_heads=2) == 256 * 1024  # replicated when tp > KV heads
    row = ParamSpec("o_proj.weight", (1024, 1024), "rowwise")
    assert row.local_numel(tp=4, fsdp=3, num_kv_heads=8) == 342 * 256  # FSDP's first rank takes the ceiling
    assert ParamSpec("norm.weight", (1024,), "norm").local_numel(tp=8, fsdp=1, num_kv_heads=8) == 1024


@pytest.mark.parametrize("preset", ["llama-1b", "llama-deep"])
def test_every_proposed_layout_passes_meshtron_preflight(preset):
    """Each candidate, written as a train config, is accepted by ``meshtron train``'s own checks. llama-1b
    ties its embeddings, which pipeline stages cannot share: the planner must propose no pipeline for it;
    llama-deep (8 untied layers) gets pipelines, interleaved ones included."""
    from meshtron.config import ModelConfig
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.report import train_config
    from meshtron.plan.search import candidate_layouts
    from meshtron.train.trainer import preflight

    hf_config = make_preset_config(preset, 259)
    shape = ModelShape.from_hf_config(hf_config)
    workload = Workload(seq_len=1024, global_batch=32)
    layouts = candidate_layouts(shape, hf_config, workload, 16, hardware("h100"))
    assert {layout.cp for layout in layouts} >= {1, 2, 4}
    schedules = {layout.pp_schedule for layout in layouts if layout.pp > 1}
    assert schedules == (set() if preset == "llama-1b" else {"1F1B", "Interleaved1F1B"})
    for layout in layouts:
        plan = preflight(train_config(layout, workload, ModelConfig(preset=preset)), 16, "cuda")
        assert plan.dims.product == 16 and (plan.dims.tp, plan.dims.cp, plan.dims.pp) == (layout.tp, layout.cp, layout.pp)
