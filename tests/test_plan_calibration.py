"""The planner against measured GPU runs: ``tests/fixtures/h100-2026-11-26.json``, a copy of
``shared/gpu-measurements/h100-2026-11-26.json`` (one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, transformers 5.17,
measured 2026-11-26 with ``bench/throughput.py`` and ``meshtron train --rehearse``), and
``tests/fixtures/h200-2026-11-28.json`` (one NVIDIA H200, the same software, measured 2026-11-28 with
``bench/one_gpu_checks/issue61.sh``).

Every meshtron run of those files is planned from its own settings (meshtron CLI overrides, read through
``load_config`` and ``config_view``, the path ``meshtron train`` and ``--rehearse`` take): the planner must be
within 10% of its activations (where measured) and peak memory and within 15% of its step time (the rehearsal:
its compute-only step against the planner's compute time). meshtron.plan.calibration says which of these runs
fitted a constant and which are predictions.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "h100-2026-11-26.json"
FIXTURES = {FIXTURE: "h100", FIXTURE.with_name("h200-2026-11-28.json"): "h200"}
"""Each recorded file and the planner's GPU (meshtron.plan.hardware.GPUS) it was measured on."""
MEMORY_RTOL = 0.10
STEP_RTOL = 0.15
GIB = 2**30
"""``peak_memory_gb`` of the throughput runs is ``torch.cuda.max_memory_allocated / 2**30`` (bench/throughput.py,
from metrics.jsonl's ``max_memory_gb``); the rehearsal's figures and ``activations_kept_gb`` are bytes / 1e9."""


def _recorded() -> dict:
    data = json.loads(FIXTURE.read_text())
    assert data["machine"]["device"] == "NVIDIA H100 80GB HBM3" and data["machine"]["date"] == "2026-11-26"
    return data


def _throughput_runs(fixture: Path = FIXTURE) -> list[dict]:
    """The meshtron runs of ``fixture`` (the peers' have no meshtron settings)."""
    runs = json.loads(fixture.read_text())["runs"]
    return [run for run in runs if any(item.startswith("model.preset=") for item in run.get("settings", []))]


def _every_throughput_run() -> list[tuple[Path, dict]]:
    return [(fixture, run) for fixture in FIXTURES for run in _throughput_runs(fixture)]


def _rehearsal() -> dict:
    (run,) = [run for run in _recorded()["runs"] if "--rehearse" in run.get("command", "")]
    return run


def _plan(settings: list[str], world_size: int, gpu: str = "h100"):
    """The planner's memory and step for a run of ``settings`` on ``world_size`` of ``gpu`` (rank 0)."""
    from meshtron.config import load_config
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.build import load_hf_config
    from meshtron.plan.hardware import GPUS
    from meshtron.plan.memory import config_view, memory_per_pipeline_rank
    from meshtron.plan.throughput import estimate_step

    cfg = load_config(None, settings, env={})
    shape, layout, workload = config_view(cfg, world_size, "cuda")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code, cfg.model.name_or_path)
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    memory = memory_per_pipeline_rank(shape, layout, workload)[0]
    return memory, estimate_step(shape, layout, workload, GPUS[gpu], hf_config), workload


def _within(name: str, planned: float, measured: float, rtol: float, failures: list[str], lines: list[str]) -> None:
    error = planned / measured - 1
    lines.append(f"  {name:12s} measured {measured:9.4f} planned {planned:9.4f} {error:+7.1%}")
    if abs(error) > rtol:
        failures.append(f"{name}: planned {planned:.4f} vs measured {measured:.4f} ({error:+.1%}, bound {rtol:.0%})")


@pytest.mark.parametrize(
    "fixture, run",
    _every_throughput_run(),
    ids=lambda value: value.stem[:4] if isinstance(value, Path) else value["what"].split(",", 1)[-1].strip(),
)
def test_planner_is_within_bounds_of_a_measured_gpu_run(fixture, run):
    memory, step, workload = _plan(run["settings"], 1, FIXTURES[fixture])
    failures, lines = [], [f"{run['what']} ({fixture.name})"]
    if "activations_kept_gb" in run:
        _within("activations", memory.activations / 1e9, run["activations_kept_gb"], MEMORY_RTOL, failures, lines)
    _within("peak", memory.total / GIB, run["peak_memory_gb"], MEMORY_RTOL, failures, lines)
    measured_step = workload.global_batch * workload.seq_len / run["tokens_per_s"]
    _within("step s", step.seconds, measured_step, STEP_RTOL, failures, lines)
    print("\n".join(lines))
    assert not failures, failures


def test_planner_is_within_bounds_of_the_measured_tp8_rehearsal():
    """llama-8b, tp=8, seq 8192, rank 0 rehearsed alone (fake collectives): state, activations and peak memory, and
    its step without communication against the planner's compute time."""
    run = _rehearsal()
    words = shlex.split(run["command"])
    world = int(words[words.index("--nproc") + 1])
    settings = [word.removeprefix("--") for word in words if word.startswith("--") and "=" in word]
    memory, step, _ = _plan(settings, world)
    measured = run["measured"]
    failures, lines = [], [f"{run['what']} ({FIXTURE.name})"]
    _within("state", (2 * memory.params + memory.optimizer) / 1e9, measured["state_gb"], 0.01, failures, lines)
    _within("activations", memory.activations / 1e9, measured["activations_kept_gb"], MEMORY_RTOL, failures, lines)
    _within("peak", memory.total / 1e9, measured["peak_memory_gb"], MEMORY_RTOL, failures, lines)
    _within("compute s", step.compute_s, measured["step_s_without_communication"], STEP_RTOL, failures, lines)
    print("\n".join(lines))
    assert not failures, failures


def test_one_gpu_plan_recommends_a_big_micro_batch_within_the_measured_bounds(capsys):
    """``meshtron plan --model llama-1b --gpus 1 --seq-len 2048 --global-batch 8``: small micro-batches lose matmul
    efficiency and pay a gradient pass each, so the plan recommends micro-batch 8 or 4 (not 1), micro-batch 1 is
    planned slower than 8, and the micro-batch-8 row is within the bounds of the measured b8 run."""
    from meshtron.cli import main

    capsys.readouterr()
    status = main(["plan", "--model", "llama-1b", "--gpus", "1", "--seq-len", "2048", "--global-batch", "8", "--json"])
    out = capsys.readouterr().out
    assert status == 0
    candidates = json.loads(out[: out.rindex("}") + 1])["candidates"]
    best = candidates[0]["layout"]
    assert best["micro_batch"] in (4, 8), best
    plain = {c["layout"]["micro_batch"]: c for c in candidates if c["layout"]["activation_checkpointing"] == "none"}
    assert plain[1]["tokens_per_s"] < 0.9 * plain[8]["tokens_per_s"]

    (run,) = [r for r in _throughput_runs() if r["settings"][-1] == "train.global_batch_size=8"]
    row = plain[8]
    failures, lines = [], ["meshtron plan micro-batch 8 row vs the measured b8 run"]
    _within("activations", row["memory_gb"]["activations"], run["activations_kept_gb"], MEMORY_RTOL, failures, lines)
    _within("peak", row["memory_gb"]["total"] * 1e9 / GIB, run["peak_memory_gb"], MEMORY_RTOL, failures, lines)
    _within("step s", row["step_s"], 8 * 2048 / run["tokens_per_s"], STEP_RTOL, failures, lines)
    print("\n".join(lines))
    assert not failures, failures


def test_float8_and_unfused_loss_move_the_plan_as_measured():
    """The direction of each setting's effect (the bounds above hold the size): float8 plans less memory and a
    shorter step than bf16, the unfused loss more memory; seq 8192 at the same tokens plans the same memory and a
    longer step (attention grows with the span)."""
    runs = {run["what"]: run for run in _throughput_runs()}
    plans = {what: _plan(run["settings"], 1) for what, run in runs.items()}
    base = next(what for what in runs if "defaults" in what)
    for what, (memory, step, _) in plans.items():
        measured = runs[what]
        base_memory, base_step, _ = plans[base]
        same_memory = abs(measured["peak_memory_gb"] / runs[base]["peak_memory_gb"] - 1) < 0.01
        if not same_memory:
            assert (memory.total > base_memory.total) == (measured["peak_memory_gb"] > runs[base]["peak_memory_gb"])
        faster = measured["tokens_per_s"] > runs[base]["tokens_per_s"]
        assert (step.tokens_per_s > base_step.tokens_per_s) == faster, what


def test_rowwise_float8_plans_its_block_matmuls_at_the_bf16_rate():
    """``precision.float8_recipe`` reaches the planner: rowwise (measured on an H200 no faster than bf16) plans a
    longer step than tensorwise and no shorter one than bf16 plus float8's casts; its memory is tensorwise's."""
    base = ["model.preset=llama-1b", "data.seq_len=2048", "train.global_batch_size=8", "precision.mixed_precision=bf16"]
    bf16 = _plan(base, 1, "h200")
    tensorwise = _plan([*base, "precision.float8=true"], 1, "h200")
    rowwise = _plan([*base, "precision.float8=true", "precision.float8_recipe=rowwise"], 1, "h200")
    assert rowwise[2].float8_recipe == "rowwise"
    assert tensorwise[1].seconds < bf16[1].seconds < rowwise[1].seconds
    assert rowwise[0].total == tensorwise[0].total
