"""What a run tells its user: the saved line, the done line and its commands, the first and last logged steps, the
progress line's time left; and a resumed run's segments (config per resume segment, run.json) and the warning of a
learning rate that jumps."""

from __future__ import annotations

import io
import json
import re
import shlex
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_main

from meshtron.checkpoint.earlier_runs import earlier_run_notice, find_earlier_run
from meshtron.command import meshtron_command
from meshtron.config import load_config, save_config, to_dict, to_toml
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.precision import precision_policy
from meshtron.distributed.runtime import Runtime
from meshtron.metrics.plot import compare_runs
from meshtron.metrics.runs import read_run
from meshtron.metrics.step_log import Eta, MetricsLogger, format_duration
from meshtron.models.build import load_hf_config
from meshtron.train.optim.build import lr_at
from meshtron.train.run.messages import saved_message, settings_summary
from meshtron.train.run.segments import schedule_change_warning, start_segment

CPU = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_format_duration():
    assert [format_duration(s) for s in (0, 0.4, 45, 59.6, 60, 192, 3599, 3600, 7500, 86399, 86400, 273600)] == [
        "0s",
        "0s",
        "45s",
        "1m00s",
        "1m00s",
        "3m12s",
        "59m59s",
        "1h00m",
        "2h05m",
        "23h59m",
        "1d00h",
        "3d04h",
    ]


def test_eta_from_the_measured_step_time():
    """The first row: its own step time x the steps left; later rows: the wall time per step between the rows of the
    window (steps that were not logged count); a rollback (a step again) measures afresh."""
    eta = Eta(total_steps=100, window=3)
    assert eta.update(1, now=10.0) is None  # step 1's own time holds the warm-up: nothing measured yet
    assert eta.update(11, now=20.0) == pytest.approx(1.0 * 89)  # 10 s over 10 steps
    assert eta.update(21, now=40.0) == pytest.approx(1.5 * 79)  # 30 s over 20 steps
    assert eta.update(31, now=50.0) == pytest.approx(1.5 * 69)  # the window forgot step 1: 30 s over 20 steps
    assert eta.update(100, now=60.0) == 0.0
    assert eta.update(91, now=61.0) is None  # rolled back: measured afresh
    assert eta.update(92, now=64.0) == pytest.approx(3.0 * 8)


def test_the_progress_line_shows_the_time_left_and_the_first_and_last_steps_are_logged(tmp_path, monkeypatch):
    """With run.log_every=4 over 10 steps: steps 1, 4, 8 and 10 are due, and the first step of a start (a resume at
    step 6); the progress line ends in `eta` from the second row on, except at the last step; a rolled-back row
    prints no progress line."""
    from meshtron.metrics import step_log

    clock = iter([0.0, 100.0, 112.0, 150.0, 200.0, 300.0])  # each logger's start, each row's log time
    monkeypatch.setattr(step_log.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, 10, enabled=True, progress=True, stream=stream, log_every=4)
    assert [step for step in range(1, 11) if logger.due(step)] == list(range(1, 11))  # nothing logged yet
    row = {"loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": None, "max_memory_gb": 0.1}
    logger.log({"step": 1, **row})
    assert [step for step in range(1, 11) if logger.due(step)] == [1, 4, 8, 10]
    logger.log({"step": 4, **row})  # 12 s over 3 steps: 4 s a step, 6 steps left
    logger.log({"step": 5, "loss": float("nan"), "grad_norm": 1.0, "lr": 1e-3, "rolled_back_to": 4})
    logger.log({"step": 10, **row})
    logger.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "eta" not in lines[0] and lines[1].endswith(" | eta 24s") and "eta" not in lines[2]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 4, 5, 10]
    resumed = MetricsLogger(tmp_path, 10, enabled=False, progress=False, log_every=4)
    assert resumed.due(6)  # on every rank alike (this one writes nothing)
    resumed.log({"step": 6, **row})
    assert [step for step in range(6, 11) if resumed.due(step)] == [8, 10]


def test_a_step_row_has_the_mfu_of_the_models_flops_over_the_worlds_peak(monkeypatch):
    """A metrics row's MFU: training FLOPs per token (by hand: 6 x 98,304 matmul weights + 3 x 8,192 of causal
    attention at seq_len 32) x tokens/s over the peak of every rank; None where the peak is unknown (CPUs); the fp16
    loss scale and the step's other metrics after the fixed fields."""
    from transformers import LlamaConfig

    from meshtron.metrics import step_row
    from meshtron.metrics.step_row import StepRow

    hf_config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128
    )
    hf_config.vocab_size = 256
    cfg = load_config(None, ["data.seq_len=32"], env={})
    cpu = StepRow(hf_config, cfg.model, cfg.lora, cfg.data.seq_len, torch.device("cpu"), 4)
    assert cpu(1, 2.0, 1.0, 1e-3, 1000.0, 0.123456)["mfu"] is None
    monkeypatch.setattr(step_row, "device_peak_flops", lambda device: 1e12)
    row = StepRow(hf_config, cfg.model, cfg.lora, cfg.data.seq_len, torch.device("cpu"), 4)(
        3, 2.0, 1.0, 1e-3, 1000.0, 0.123456, 512.0, {"router": 0.5}
    )
    assert row["mfu"] == pytest.approx((6 * 98_304 + 3 * 8_192) * 1000.0 / (4 * 1e12))
    fixed = ["step", "loss", "grad_norm", "lr", "tokens_per_s", "step_s", "mfu", "max_memory_gb"]
    assert list(row) == [*fixed, "loss_scale", "router"]
    assert (row["step"], row["step_s"], row["loss_scale"], row["router"]) == (3, 0.1235, 512.0, 0.5)


def test_the_saved_line():
    path = Path("runs/a/checkpoints/step-00000010")
    assert saved_message(10, path, 1.234) == f"meshtron: saved the checkpoint of step 10 to {path} (1.2s)"
    assert saved_message(10, path, 4.06, 0.31) == (
        f"meshtron: saved the checkpoint of step 10 to {path} (async: complete 4.1s after it began, training paused "
        "0.3s)"
    )


def test_the_lr_jump_warning_names_the_settings_and_the_rates():
    def train_cfg(*extra: str):
        base = ["train.steps=10", "optimizer.lr=3e-4", "schedule.min_lr=3e-5", "schedule.warmup_steps=2"]
        return load_config(None, [*base, *extra], env={})

    saved, longer = train_cfg(), train_cfg("train.steps=20")
    old, new = lr_at(5, saved), lr_at(5, longer)
    assert new > old
    warning = schedule_change_warning(saved, longer, 5, old, new)
    assert warning.startswith(
        f"meshtron: warning: train.steps 10 -> 20 changes the cosine schedule: lr at step 6 jumps {old:.2e} -> "
        f"{new:.2e}; "
    )
    two = schedule_change_warning(saved, train_cfg("schedule.kind=linear", "optimizer.lr=1e-4"), 5, old, 0.5 * old)
    assert (
        "optimizer.lr 0.0003 -> 0.0001, schedule.kind cosine -> linear change the schedule: lr at step 6 drops" in two
    )
    unknown = schedule_change_warning(None, longer, 5, old, new)
    assert "the learning-rate settings change the cosine schedule: lr at step 6 jumps" in unknown
    # The rate does not change: no warning (WSD extended in its stable phase, a setting the rate does not use).
    wsd = ["schedule.kind=wsd", "schedule.decay_fraction=0.2"]
    assert lr_at(5, train_cfg(*wsd)) == lr_at(5, train_cfg(*wsd, "train.steps=20"))
    assert schedule_change_warning(train_cfg(*wsd), train_cfg(*wsd, "train.steps=20"), 5, 3e-4, 3e-4) is None
    assert schedule_change_warning(saved, saved, 5, old, old * (1 + 1e-9)) is None
    assert schedule_change_warning(saved, longer, 5, None, new) is None  # nothing to compare with


def saved_checkpoint(directory: Path, step: int) -> Path:
    """A whole checkpoint folder of ``step`` (one small tensor), as CheckpointManager writes it."""
    from meshtron.checkpoint.manager import CheckpointManager

    class State:
        def state_dict(self):
            return {"w": torch.ones(2)}

    CheckpointManager(directory, 1, 0, False, CPU).save(step, State(), {"step": step}, "")
    return directory / f"step-{step:08d}"


def segment_plan(layout: str, resume_from: Path | None):
    return SimpleNamespace(
        dims=SimpleNamespace(describe=lambda: layout),
        resume_from=resume_from,
        hf_config=SimpleNamespace(model_type="llama"),
    )


def cfg_of(out: Path, *extra: str):
    return load_config(None, [f"run.output_dir={out}", "data.seq_len=16", "train.global_batch_size=8", *extra], env={})


def test_config_per_resume_segment_under_another_layout(tmp_path):
    """A run of 3 steps under FSDP4, resumed in its folder at step 3 under DP2 x TP2 with 16 sequences a step, then at
    step 5 again (the same settings: a restart goes on in its segment), then from step 3 again with another
    setting: config.toml is the current segment's, each segment keeps its config, run.json lists the segments, and
    `meshtron plot` / `compare` read them (label, tokens)."""
    out = tmp_path / "run"
    out.mkdir()
    first = cfg_of(out, "parallel.dp_shard=4")
    start_segment(first, out, segment_plan("dp_shard=4", None), 4)
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "run.json"]  # one segment: no copy
    at_3 = saved_checkpoint(out / "checkpoints", 3)
    second = cfg_of(out, "parallel.dp_shard=2", "parallel.tp=2", "train.global_batch_size=16")
    start_segment(second, out, segment_plan("dp_shard=2 tp=2", at_3), 4)
    info = json.loads((out / "run.json").read_text())
    assert info["segments"] == [
        {"first_step": 1, "layout": "dp_shard=4", "world_size": 4, "tokens_per_step": 128,
         "config": "config-from-step-00000001.toml"},
        {"first_step": 4, "layout": "dp_shard=2 tp=2", "world_size": 4, "tokens_per_step": 256,
         "config": "config-from-step-00000004.toml", "resumed_from": str(at_3)},
    ]  # fmt: skip
    assert (info["layout"], info["tokens_per_step"], info["family"]) == ("dp_shard=2 tp=2", 256, "llama")
    assert load_config(out / "config-from-step-00000001.toml", env={}) == first
    assert (out / "config.toml").read_text() == (out / "config-from-step-00000004.toml").read_text() == to_toml(second)
    # The same settings and layout again from a later checkpoint: the same segment.
    start_segment(second, out, segment_plan("dp_shard=2 tp=2", saved_checkpoint(out / "checkpoints", 5)), 4)
    assert json.loads((out / "run.json").read_text())["segments"] == info["segments"]
    rows = [{"step": step, "loss": 3.0 - 0.1 * step, "tokens_per_s": 100.0} for step in range(1, 7)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = read_run(out)
    assert run.label == "run (dp_shard=4; from step 4: dp_shard=2 tp=2)"
    assert run.tokens == [128, 256, 384, 640, 896, 1152]  # 128 a step up to step 3, 256 a step after
    said: list[str] = []
    assert compare_runs(out, out, 1e-5, said.append) == 0 and said[0] == f"A: {run.label}\nB: {run.label}"
    # From step 3 again, with another learning rate: the segment from step 4 is replaced.
    third = cfg_of(out, "parallel.dp_shard=2", "parallel.tp=2", "train.global_batch_size=16", "optimizer.lr=1e-4")
    start_segment(third, out, segment_plan("dp_shard=2 tp=2", at_3), 4)
    segments = json.loads((out / "run.json").read_text())["segments"]
    assert [s["first_step"] for s in segments] == [1, 4]
    assert load_config(out / segments[1]["config"], env={}) == third == load_config(out / "config.toml", env={})


def test_a_run_json_written_before_segments_still_plots_and_gets_them_on_resume(tmp_path):
    """An old run.json (layout, world size, tokens per step): read as one segment; a resume under another layout
    keeps its config as the first segment's."""
    out = tmp_path / "old"
    out.mkdir()
    old = {"layout": "dp_shard=2", "world_size": 2, "family": "llama", "tokens_per_step": 128}
    (out / "run.json").write_text(json.dumps(old))
    (out / "config.toml").write_text(to_toml(cfg_of(out)))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)))
    run = read_run(out)
    assert run.label == "old (dp_shard=2)" and run.tokens == [128, 256]
    assert run.segments == [
        {"first_step": 1, "layout": "dp_shard=2", "world_size": 2, "tokens_per_step": 128, "config": "config.toml"}
    ]
    start_segment(cfg_of(out, "train.steps=20"), out, segment_plan("single process", saved_checkpoint(out, 2)), 1)
    segments = json.loads((out / "run.json").read_text())["segments"]
    assert [(s["first_step"], s["layout"], s["config"]) for s in segments] == [
        (1, "dp_shard=2", "config-from-step-00000001.toml"),
        (3, "single process", "config-from-step-00000003.toml"),
    ]
    assert load_config(out / "config-from-step-00000001.toml", env={}) == cfg_of(out)
    assert read_run(out).label == "old (dp_shard=2; from step 3: single process)"


def printed_commands(stdout: str) -> dict[str, list[str]]:
    """The commands the done line prints (label -> arguments after the meshtron command), checked to start with
    meshtron_command()."""
    commands = {}
    for label, line in re.findall(r"^  ([a-z ]+):\s+(.+)$", stdout, re.MULTILINE):
        assert line.startswith(meshtron_command() + " "), line
        commands[label] = shlex.split(line[len(meshtron_command()) :])
    return commands


def test_a_run_and_its_resume_say_what_they_did_and_their_commands_run_as_printed(tmp_path, cache_dir):
    """4 steps logged every 3 (steps 1, 3 and 4 logged), saved at step 4 (its line), the done line with the
    checkpoint and the commands; the printed `train on` command (with another optimizer.lr and global batch) resumes in
    the run's folder: the lr-jump warning, the rates of the new settings, "4 steps (5-8)", a config per segment;
    the printed export command exports."""
    out = tmp_path / "run"
    settings = [
        "--model.preset=tiny",
        "--data.max_documents=30",
        "--data.seq_len=16",
        f"--data.cache_dir={cache_dir}",
        "--train.steps=4",
        "--train.global_batch_size=2",
        "--optimizer.lr=3e-3",
        "--schedule.warmup_steps=1",
        "--run.log_every=3",
        "--run.progress=false",
        "--checkpoint.interval=4",
        f"--run.output_dir={out}",
    ]
    first = run_main(["train", *settings])
    assert first.returncode == 0, first.stderr
    checkpoint = out / "checkpoints" / "step-00000004"
    saved_line = rf"^meshtron: saved the checkpoint of step 4 to {re.escape(str(checkpoint))} \(\d+\.\ds\)$"
    assert re.search(saved_line, first.stdout, re.M), first.stdout
    done_line = r"^meshtron: done, 4 steps, loss [\d.]+ -> [\d.]+; outputs in (.+)/ \(.*\); latest checkpoint (.+)$"
    done = re.search(done_line, first.stdout, re.M)
    assert done and done.groups() == (str(out), str(checkpoint)), first.stdout
    commands = printed_commands(first.stdout)
    assert commands["see the curves"] == ["plot", str(out)]
    assert commands["train on"] == [
        "train", "--config", str(out / "config.toml"), f"--checkpoint.resume={checkpoint}", "--train.steps=8"
    ]  # fmt: skip
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 3, 4]

    resumed = run_main([*commands["train on"], "--optimizer.lr=1e-3", "--train.global_batch_size=4"])
    assert resumed.returncode == 0, resumed.stderr
    saved_cfg, cfg = (
        load_config(out / "config-from-step-00000001.toml", env={}),
        load_config(out / "config.toml", env={}),
    )
    assert (cfg.train.steps, cfg.optimizer.lr, saved_cfg.train.steps, saved_cfg.optimizer.lr) == (8, 1e-3, 4, 3e-3)
    old, new = lr_at(4, saved_cfg), lr_at(4, cfg)
    warning = (
        f"meshtron: warning: train.steps 4 -> 8, optimizer.lr 0.003 -> 0.001 change the cosine schedule: lr at step 5 "
        f"jumps {old:.2e} -> {new:.2e}; "
    )
    assert warning in resumed.stdout and old < new
    assert re.search(r"^meshtron: done, 4 steps \(5-8\), loss", resumed.stdout, re.M), resumed.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 3, 4, 5, 6, 8]  # the first step of the resumed start, too
    assert [row["lr"] for row in rows[3:]] == pytest.approx([lr_at(s - 1, cfg) for s in (5, 6, 8)])
    segments = json.loads((out / "run.json").read_text())["segments"]
    assert [(s["first_step"], s["tokens_per_step"], s["config"]) for s in segments] == [
        (1, 32, "config-from-step-00000001.toml"),
        (5, 64, "config-from-step-00000005.toml"),
    ]
    assert read_run(out).tokens == [32, 96, 128, 192, 256, 384]

    exported = printed_commands(resumed.stdout)["export it"]
    assert exported[:2] == ["export", str(out / "checkpoints" / "step-00000008")]
    assert run_main(exported).returncode == 0 and (Path(exported[2]) / "config.json").is_file()


# Settings -> the words the start-up line must show for them (issue 57: hybrid CP showed as ``cp=4``, bf16 weights as
# "no mixed precision", tiled MLPs, offloading, rope scaling, the objective and LoRA's rank not at all).
SHOWN = [
    ([], 1, ["layout: single process |", "float32 weights, no mixed precision", "causal LM", "document masks (sdpa)"]),
    (
        ["parallel.cp=4", "parallel.cp_method=hybrid", "parallel.cp_ulysses=2"],
        4,
        ["cp=4 (hybrid: ulysses 2 x ring 2)"],
    ),
    (["parallel.cp=2", "parallel.cp_method=ulysses"], 2, ["cp=2 (ulysses)"]),
    (["parallel.tp=2", "parallel.sequence_parallel=false"], 2, ["tp=2 (no sequence parallel)"]),
    (["parallel.ep=2"], 2, ["dp_shard=2 ep=2"]),
    (["fsdp.cpu_offload=true"], 1, ["optimizer state in host memory (fsdp.cpu_offload)"]),
    (["model.dtype=bfloat16"], 1, ["bfloat16 weights, no mixed precision"]),
    (["precision.mixed_precision=bf16"], 1, ["float32 weights, bf16 compute, gradients reduced in float32"]),
    (["precision.mixed_precision=fp16", "fsdp.reduce_dtype=none"], 1, ["fp16 compute with loss scaling", "in fp16"]),
    (["precision.float8=true", "precision.float8_recipe=rowwise"], 1, ["float8 rowwise matmuls"]),
    (["train.mlp_tiles=4"], 1, ["MLP in 4 tiles"]),
    (["train.activation_offload=true"], 1, ["activations offloaded to host memory"]),
    (["train.activation_checkpointing=selective"], 1, ["activation checkpointing selective"]),
    (['model.rope_scaling={"rope_type": "yarn", "factor": 4.0}'], 1, ["rope scaling yarn x4"]),
    (["model.max_position_embeddings=4096"], 1, ["4,096 positions"]),
    (["lora.rank=8", "lora.targets=q_proj,v_proj"], 1, ["LoRA rank 8 alpha 16 on q_proj,v_proj"]),
    (["optimizer.name=muon"], 1, ["muon optimizer"]),
    (["data.format=chat"], 1, ["causal LM, chat: loss on the assistant's tokens"]),
    (["data.mask_documents=false"], 1, ["no document masks"]),
    (["train.loss_chunk_size=0"], 1, ["logits whole"]),
    (["train.batch_rampup=2:10"], 1, ["batch rampup 2:10"]),
    (["model.preset=deepseekv3-tiny"], 1, ["8 experts, router bias balancing"]),  # auto: DeepSeek-V3's own bias
    (["model.preset=qwen3moe-tiny", "moe.router_aux_loss=true"], 1, ["4 experts, router aux loss"]),
    (["model.preset=qwen3moe-tiny", "moe.router_balance=bias"], 1, ["4 experts, router bias balancing"]),
]


@pytest.mark.parametrize("overrides, world, words", SHOWN)
def test_startup_line_shows_what_is_on(overrides, world, words):
    cfg = load_config(None, overrides, env={})
    dims = ParallelDims.from_config(cfg.parallel, world)
    setup = SimpleNamespace(
        dims=dims, compiled=False, attention_kernel="sdpa", hf_config=load_hf_config(cfg.model, 257)
    )
    line = settings_summary(cfg, setup, _policy(cfg, "cpu"))
    for word in words:
        assert word in line, (overrides, line)
    assert "\n" not in line


def test_startup_line_shows_compiled_blocks():
    cfg = load_config(None, [], env={})
    dims = ParallelDims.from_config(cfg.parallel, 1)
    compiled = SimpleNamespace(
        dims=dims, compiled=True, attention_kernel="flex", hf_config=load_hf_config(cfg.model, 257)
    )
    assert "compiled blocks" in settings_summary(cfg, compiled, _policy(cfg, "cpu"))
    eager = SimpleNamespace(dims=dims, compiled=False, attention_kernel="flex", hf_config=compiled.hf_config)
    assert "compiled" not in settings_summary(cfg, eager, _policy(cfg, "cpu"))


def earlier_run(runs: Path, name: str, overrides: list[str], step: int | None) -> Path:
    """A run folder as a run leaves it: its config.toml, and a ``latest`` marker naming the checkpoint of ``step``."""
    folder = runs / name
    (folder / "checkpoints").mkdir(parents=True)
    save_config(load_config(None, [*overrides, f"run.output_dir={folder}"], env={}), folder / "config.toml")
    if step is not None:
        (folder / "checkpoints" / "latest").write_text(f"step-{step:08d}")
    return folder


SAME = ["train.steps=6", "optimizer.lr=1e-3", "checkpoint.interval=3"]


def test_an_earlier_run_of_the_same_settings_is_named_with_its_resume(tmp_path):
    runs = tmp_path / "runs"
    folder = earlier_run(runs, "20260101-000000", SAME, 3)
    earlier_run(runs, "other-lr", ["train.steps=6", "optimizer.lr=2e-3", "checkpoint.interval=3"], 3)
    earlier_run(runs, "no-checkpoint", SAME, None)
    notice = earlier_run_notice(to_dict(load_config(None, SAME, env={})), runs)
    assert notice == (
        f"meshtron: note: {folder} holds an earlier run of the same settings with a checkpoint of step 3 of 6; this "
        f"one starts over from step 1 in a new folder: to resume that one instead, run the same command with "
        f"--run.output_dir={folder}"
    )
    # What does not change the model trained does not count: the layout, logging, checkpoint frequency, compile.
    other_how = [*SAME, "parallel.tp=2", "run.loggers=jsonl,tensorboard", "checkpoint.interval=5", "train.compile=true"]
    assert find_earlier_run(to_dict(load_config(None, other_how, env={})), runs).output_dir == folder
    done = tmp_path / "done"
    assert earlier_run_notice(to_dict(load_config(None, SAME, env={})), done) is None  # no runs folder yet
    earlier_run(done, "a", SAME, 6)
    assert "finished (checkpoint of step 6, train.steps=6)" in earlier_run_notice(
        to_dict(load_config(None, SAME, env={})), done
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.lr=2e-3"],  # another model
        ["data.seq_len=128"],
        ["run.output_dir=elsewhere"],  # a folder chosen: nothing to tell
        ["checkpoint.resume=none"],  # starting over on purpose
        ["checkpoint.dir=/shared/ckpt"],  # resume=auto already resumes from there
    ],
)
def test_no_earlier_run_is_named_for_other_settings_or_a_chosen_folder(tmp_path, overrides):
    runs = tmp_path / "runs"
    earlier_run(runs, "20260101-000000", SAME, 3)
    assert earlier_run_notice(to_dict(load_config(None, [*SAME, *overrides], env={})), runs) is None


def test_running_the_same_command_again_names_the_earlier_run(tmp_path, monkeypatch, cache_dir):
    """One process, in this process: the second start of the same command names the first's folder (its config.toml
    as the run wrote it) and trains in a new one."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "--model.preset=tiny", "--data.max_documents=5", "--data.seq_len=16", "--train.steps=2"]
    args += ["--run.progress=false", "--checkpoint.interval=2", f"--data.cache_dir={cache_dir}"]
    first = run_main(args)
    assert first.returncode == 0, first.stderr[-2000:]
    [folder] = (tmp_path / "runs").iterdir()
    assert "holds an earlier run" not in first.stdout
    time.sleep(1.1)  # runs/<timestamp> has seconds
    second = run_main([*args, "--run.loggers=jsonl"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"meshtron: note: runs/{folder.name} holds an earlier run of the same settings, finished" in second.stdout
    assert len(list((tmp_path / "runs").iterdir())) == 2


def _policy(cfg, device_type):
    """The run's precision policy, as preflight makes it."""
    return precision_policy(cfg.precision, cfg.model.dtype, cfg.fsdp.reduce_dtype, device_type)
