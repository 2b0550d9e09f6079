"""Seeing runs: TensorBoard and W&B loggers, `meshtron plot`, `meshtron compare`, `meshtron generate` and
`meshtron --version`."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest
import torch

from meshtron.config import load_config
from meshtron.errors import ConfigError

STEPS = 6


def train_run(out: Path, *overrides: str) -> Path:
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    cfg = load_config(
        None,
        [
            "model.preset=llama-tiny",
            "data.max_documents=40",
            "data.seq_len=32",
            f"train.steps={STEPS}",
            "train.global_batch_size=4",
            "run.progress=false",
            f"run.output_dir={out}",
            "eval.holdout_documents=4",  # evaluated after steps 3 and 6
            "eval.interval=3",
            "eval.batches=1",
            *overrides,
        ],
        env={},
    )
    train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run logging to TensorBoard and W&B (offline), a re-run of it, and a run with another seed."""
    root = tmp_path_factory.mktemp("runs")
    train_run(
        root / "logged",
        "run.loggers=jsonl,tensorboard,wandb",
        "run.wandb_mode=offline",
        "run.wandb_project=meshtron-test",
        f"checkpoint.interval={STEPS}",
    )
    train_run(root / "rerun")
    train_run(root / "other-seed", "train.seed=8")
    return root


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def wandb_records(run: Path) -> list:
    """The records of an offline W&B run file (LevelDB-style log: 32 KiB blocks of [crc, length, type] chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))[0]).read_bytes()
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_tensorboard_events_hold_the_metrics_rows(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "logged" / "tensorboard"))
    events.Reload()
    rows = metrics(runs / "logged")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "max_memory_gb"):
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [row["step"] for row in rows] == list(range(1, STEPS + 1))
        assert [s.value for s in scalars] == pytest.approx([row[key] for row in rows], rel=1e-6)
    evaluations = events.Scalars("eval/loss")
    assert [(s.step, s.value) for s in evaluations] == [
        (row["step"], pytest.approx(row["eval_loss"], rel=1e-6)) for row in rows if "eval_loss" in row
    ]
    assert [s.step for s in evaluations] == [3, 6]
    assert "single process" in events.Tensors("layout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "global_batch_size = 4" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_wandb_offline_run_holds_the_metrics_and_the_config(runs):
    records = wandb_records(runs / "logged")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    rows = metrics(runs / "logged")
    assert [h["_step"] for h in history] == [row["step"] for row in rows]
    assert [h["train/loss"] for h in history] == pytest.approx([row["loss"] for row in rows], rel=1e-9)
    assert [h["eval/loss"] for h in history if "eval/loss" in h] == [r["eval_loss"] for r in rows if "eval_loss" in r]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["layout"] == "single process" and config["train"]["global_batch_size"] == 4
    assert run.project == "meshtron-test"


def test_a_tracker_without_its_package_is_a_one_line_error(monkeypatch):
    import importlib.util

    from meshtron.metrics.trackers import check_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(None, ["run.loggers=jsonl,wandb"], env={})
    with pytest.raises(ConfigError, match=r"pip install 'meshtron\[wandb\]'"):
        check_trackers(cfg.run)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    online = load_config(None, ["run.loggers=jsonl,wandb", "run.wandb_mode=online"], env={})
    with pytest.raises(ConfigError, match="needs a W&B API key"):
        check_trackers(online.run, env={"NETRC": "/nonexistent"})
    check_trackers(online.run, env={"WANDB_API_KEY": "x" * 40})
    with pytest.raises(ConfigError, match="run.loggers: 'neptune' is not one of"):
        load_config(None, ["run.loggers=neptune"], env={})


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plot_draws_one_and_three_runs(runs, tmp_path):
    from meshtron.cli import main
    from meshtron.metrics.plot import DPI, FIGSIZE

    assert main(["plot", str(runs / "logged")]) == 0
    assert png_size(runs / "logged" / "metrics.png") == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
    three = [str(runs / name) for name in ("logged", "rerun", "other-seed")]
    assert main(["plot", *three, "-o", str(tmp_path / "three.png")]) == 0
    assert png_size(tmp_path / "three.png") == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
    assert main(["plot", *three, "-o", str(tmp_path / "three.html")]) == 0
    page = (tmp_path / "three.html").read_text()
    assert "<svg" in page and "other-seed (single process)" in page
    assert main(["plot", str(runs / "logged"), "-o", str(tmp_path / "x.pdf")]) == 2
    assert main(["plot", str(tmp_path)]) == 2  # no metrics.jsonl


def test_compare_passes_a_rerun_and_fails_another_seed(runs, capsys):
    from meshtron.cli import main

    assert main(["compare", str(runs / "logged"), str(runs / "rerun")]) == 0
    out = capsys.readouterr().out
    assert f"losses equal within --tol 1e-05 over {STEPS} steps and 2 evaluations" in out and "throughput is" in out
    assert main(["compare", str(runs / "logged"), str(runs / "other-seed")]) == 1
    out = capsys.readouterr().out
    assert "losses differ beyond --tol 1e-05" in out and "evaluation losses differ beyond --tol 1e-05 after 2" in out
    assert main(["compare", str(runs / "logged"), str(runs / "other-seed"), "--tol", "10"]) == 0


def test_compare_counts_the_last_row_of_a_restarted_step_and_fails_on_missing_steps(runs, tmp_path):
    from meshtron.metrics.plot import compare_runs

    shorter = tmp_path / "shorter"
    shorter.mkdir()
    rows = metrics(runs / "rerun")
    # A restart logged steps 3-4 twice: the last row of each step counts. Step 6 is missing.
    lines = rows[:4] + [dict(rows[2], loss=99.0), rows[2], rows[3], rows[4]]
    (shorter / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    printed = []
    assert compare_runs(runs / "rerun", shorter, 1e-5, out=printed.append) == 1
    assert "1 step(s) logged by one run only (first: 6)" in printed[-1] and "differ beyond" not in printed[-1]


def test_generate_continues_a_prompt_from_a_checkpoint_and_from_its_export(runs, tmp_path, capsys):
    """Greedy: the text equals an argmax loop over plain transformers' logits; checkpoint and export agree; a
    sampled continuation is the same for the same seed."""
    from transformers import AutoModelForCausalLM

    from meshtron.checkpoint.export import export_checkpoint
    from meshtron.checkpoint.generate import generate_text
    from meshtron.cli import main
    from meshtron.data.tokenizer import ByteTokenizer

    checkpoint = runs / "logged" / "checkpoints" / f"step-{STEPS:08d}"
    export = export_checkpoint(str(checkpoint), str(tmp_path / "export"))
    text = generate_text(str(checkpoint), "def ", max_new_tokens=12)
    assert generate_text(str(export), "def ", max_new_tokens=12) == text

    model, tok = AutoModelForCausalLM.from_pretrained(export).eval(), ByteTokenizer()
    ids = torch.tensor([list(tok.encode("def "))])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert text == tok.decode(ids[0, 4:].tolist())

    sampled = [generate_text(str(export), "def ", max_new_tokens=12, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    assert main(["generate", str(checkpoint), "--prompt", "def ", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == "def " + text + "\n"
    assert main(["generate", str(tmp_path / "nothing")]) == 2


def test_version_prints_meshtrons_torchs_and_transformers_versions():
    import transformers
    from conftest import run_main

    import meshtron

    want = f"meshtron {meshtron.__version__} (torch {torch.__version__}, transformers {transformers.__version__})\n"
    for args in (["--version"], ["--version", "plot"]):
        proc = run_main(args)
        assert (proc.returncode, proc.stdout) == (0, want), proc
