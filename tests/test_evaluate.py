"""Validation (docs/evaluation.md) in one process: held-out documents, no effect on training, the plain model's loss,
and `meshtron eval` of a checkpoint and of a model directory. Every layout's evaluation losses are checked against
one process in test_parity.py."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from meshtron.cli import main
from meshtron.config import DataConfig, load_config
from meshtron.data.dataset import build_packed_dataset
from meshtron.data.labels import IGNORE_INDEX
from meshtron.data.tokenizer import ByteTokenizer
from meshtron.data.training_data import build_training_data
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError
from meshtron.train.evaluation.evaluate_run import evaluate_run
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
DOCUMENTS = 40


def write_documents(path, count: int = DOCUMENTS):
    """Documents that name themselves ("document 7: ..."), of different lengths."""
    lines = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(count)]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def decoded(dataset, count: int) -> str:
    rows = dataset.rows(np.arange(count))
    return "".join(bytes(int(t) for t in row if t < 256).decode("utf-8", "replace") for row in rows)


def test_held_out_documents_are_never_trained_on(tmp_path):
    """eval.holdout_documents=5: the training sequences hold none of the last 5 documents' tokens; the evaluation
    sequences are cut from them alone (the first starts at document 35)."""
    source = write_documents(tmp_path / "docs.jsonl")
    data = DataConfig(path=str(source), seq_len=24, cache_dir=str(tmp_path / "cache"), shuffle=False)
    whole = build_packed_dataset(data, ByteTokenizer(), is_builder=True)
    evaluation = load_config(None, ["eval.holdout_documents=5"], env={}).eval
    run_data = build_training_data(data, ByteTokenizer(), 4, is_builder=True, evaluation=evaluation)
    trained, held = run_data.dataset, run_data.eval_dataset
    text = decoded(trained, len(trained))
    assert "document 34:" in text or "document 33:" in text  # training reaches up to the held-out documents
    assert all(f"document {i}:" not in text for i in range(35, DOCUMENTS))
    evaluated = decoded(held, len(held))
    assert evaluated.startswith("document 35:") and "document 39:" in evaluated
    assert all(f"document {i}:" not in evaluated for i in range(35))
    assert len(trained) + len(held) <= len(whole) and len(run_data.schedule.global_batch(0)) == 4


def run_config(tmp_path, *extra: str):
    return load_config(
        None,
        [
            "model.preset=llama-tiny",
            f"data.path={write_documents(tmp_path / 'train.jsonl', 120)}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.seq_len=32",
            "data.mask_documents=false",
            "train.steps=3",
            "train.global_batch_size=4",
            "optimizer.lr=3e-3",
            "run.progress=false",
            *extra,
        ],
        env={},
    )


def plain_model_loss(model, eval_dataset, sequences: int) -> float:
    """The loss of transformers' own model (with ``model``'s weights) over the first ``sequences`` evaluation
    sequences: summed token cross-entropy over their labelled tokens."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(model.state_dict())
    input_ids, labels = eval_dataset.batch(np.arange(sequences))
    with torch.no_grad():
        logits = plain(input_ids=input_ids).logits
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return total.item() / int((labels != IGNORE_INDEX).sum())


def test_evaluation_changes_no_training_and_is_the_plain_models_loss(tmp_path):
    """With evaluation after every step the training losses, gradient norms and weights are those of a run without
    it (equal, not close); each evaluation is transformers' own model's loss on the same sequences."""
    eval_source = write_documents(tmp_path / "eval.jsonl", 30)
    evaluated = train(
        run_config(
            tmp_path,
            f"eval.path={eval_source}",
            "eval.interval=1",
            "eval.batches=2",
            "run.output_dir=" + str(tmp_path / "a"),
        ),
        CPU_RUNTIME,
    )
    plain = train(run_config(tmp_path, "run.output_dir=" + str(tmp_path / "b")), CPU_RUNTIME)
    assert evaluated.losses == plain.losses and evaluated.grad_norms == plain.grad_norms
    assert all(
        torch.equal(a, b) for a, b in zip(evaluated.model.state_dict().values(), plain.model.state_dict().values())
    )
    assert [step for step, _ in evaluated.eval_losses] == [1, 2, 3]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [row["eval_loss"] for row in rows] == [loss for _, loss in evaluated.eval_losses]
    assert rows[-1]["eval_perplexity"] == pytest.approx(np.exp(rows[-1]["eval_loss"]))
    cfg = run_config(tmp_path, f"eval.path={eval_source}")
    eval_dataset = build_training_data(cfg.data, ByteTokenizer(), 4, is_builder=True, evaluation=cfg.eval).eval_dataset
    expected = plain_model_loss(evaluated.model, eval_dataset, 8)
    assert evaluated.eval_losses[-1][1] == pytest.approx(expected, rel=1e-5)
    assert rows[-1]["eval_tokens"] == 8 * 32


def test_evaluate_run_trains_nothing_and_needs_evaluation_data(tmp_path):
    """meshtron eval's entry (evaluate_run): no step trained, one evaluation at step 0 (the model as built, which is
    transformers' own model's loss) in the metrics rows; without [eval] data, the one-line error naming the settings."""
    eval_source = write_documents(tmp_path / "eval.jsonl", 30)
    cfg = run_config(tmp_path, f"eval.path={eval_source}", "eval.batches=2", f"run.output_dir={tmp_path / 'a'}")
    result = evaluate_run(cfg, CPU_RUNTIME)
    assert result.losses == [] and [step for step, _ in result.eval_losses] == [0]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["eval_loss"]) for row in rows] == result.eval_losses
    eval_dataset = build_training_data(cfg.data, ByteTokenizer(), 4, is_builder=True, evaluation=cfg.eval).eval_dataset
    assert result.eval_losses[0][1] == pytest.approx(plain_model_loss(result.model, eval_dataset, 8), rel=1e-5)
    with pytest.raises(ConfigError, match="nothing to evaluate on: set eval.path or eval.holdout_documents"):
        evaluate_run(run_config(tmp_path, f"run.output_dir={tmp_path / 'b'}"), CPU_RUNTIME)


def test_meshtron_eval_of_a_checkpoint_and_of_its_export(tmp_path, capsys):
    """`meshtron eval CHECKPOINT` (the run's own settings) and `meshtron eval EXPORTED_DIR --config ...` give the
    run's last evaluation loss; the checkpoint's run directory is left as it was."""
    run_dir = tmp_path / "run"
    cfg = run_config(
        tmp_path, "eval.holdout_documents=20", "eval.batches=2", "checkpoint.interval=3", f"run.output_dir={run_dir}"
    )
    result = train(cfg, CPU_RUNTIME)
    checkpoint = run_dir / "checkpoints" / "step-00000003"
    before = (run_dir / "metrics.jsonl").read_text()
    assert main(["eval", str(checkpoint), f"--run.output_dir={tmp_path / 'eval-ckpt'}"]) == 0
    assert "evaluated the model after step 3" in capsys.readouterr().out
    (row,) = [json.loads(line) for line in (tmp_path / "eval-ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 3 and row["eval_loss"] == pytest.approx(result.eval_losses[-1][1], rel=1e-6)
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    assert (
        main(
            [
                "eval",
                str(tmp_path / "exported"),
                "--config",
                str(checkpoint / "config.toml"),
                f"--run.output_dir={tmp_path / 'eval-export'}",
            ]
        )
        == 0
    )
    (row,) = [json.loads(line) for line in (tmp_path / "eval-export" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 0 and row["eval_loss"] == pytest.approx(result.eval_losses[-1][1], rel=1e-6)
    capsys.readouterr()
    assert main(["eval", str(checkpoint), f"--run.output_dir={run_dir}"]) == 2  # a run's directory: refused
    assert "is not empty" in capsys.readouterr().err
    assert main(["eval", str(checkpoint), "--eval.holdout_documents=0", f"--run.output_dir={tmp_path / 'x'}"]) == 2
    assert "meshtron eval needs evaluation data" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), f"--run.output_dir={tmp_path / 'y'}"]) == 2
    assert "is neither a checkpoint" in capsys.readouterr().err


class _Stage(nn.Module):
    """A pipeline stage of a toy model: the first embeds and hands on two tensors (hidden states and a carry, as
    the router loss's), the last combines them."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.layer = nn.Embedding(16, 4) if first else nn.Linear(4, 4)

    def forward(self, *args):
        if self.first:
            hidden = self.layer(args[0])
            return hidden, hidden.sum(-1)
        hidden, carry = args
        return self.layer(hidden) + carry.unsqueeze(-1)


def _runner(rank: int, stage: nn.Module):
    return SimpleNamespace(
        pp_group=None,
        modules=[stage],
        stage_ids=[rank],
        stage_ranks=[0, 1],
        holds_first=rank == 0,
        holds_last=rank == 1,
        microbatches=2,
        router=None,
        loss_parallel=False,
        loss_sum=lambda hidden, targets: (hidden.sum(-1) * targets).sum(),
    )


def test_pipeline_evaluation_sends_shapes_once_per_batch_shape(monkeypatch):
    """Two pipeline ranks (simulated in this process: rank 0 runs its sends, then rank 1 its receives): over three
    evaluation batches of two shapes, the stage output's shapes go over once per batch shape (2 object messages,
    before: one per transfer, 6), and the loss is the one-process forward's."""
    import torch.distributed as dist

    from meshtron.train.pipeline.evaluate import pipeline_eval_loss_sum

    wire, counts, rank = [], Counter(), [0]

    def send_object_list(objects, group_dst, group, device):
        counts["send_object"] += 1
        wire.append(list(objects))

    def recv_object_list(objects, group_src, group, device):
        counts["recv_object"] += 1
        objects[:] = wire.pop(0)

    monkeypatch.setattr(dist, "send_object_list", send_object_list)
    monkeypatch.setattr(dist, "recv_object_list", recv_object_list)
    monkeypatch.setattr(dist, "send", lambda tensor, group_dst, group: wire.append(tensor.clone()))
    monkeypatch.setattr(dist, "recv", lambda tensor, group_src, group: tensor.copy_(wire.pop(0)))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank[0])
    torch.manual_seed(0)
    first, last = _Stage(first=True), _Stage(first=False)
    batches = [(torch.randint(0, 16, (rows, 6)), torch.randn(rows, 6)) for rows in (4, 4, 2)]
    runners = [_runner(0, first), _runner(1, last)]
    for rank[0] in (0, 1):
        losses = [pipeline_eval_loss_sum(runners[rank[0]], ids, labels) for ids, labels in batches]
    assert not wire
    assert counts == {"send_object": 2, "recv_object": 2}
    expected = [(last(*first(ids)).sum(-1) * labels).sum() for ids, labels in batches]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
