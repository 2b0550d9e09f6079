"""Preference objectives in training (docs/post-training.md): the LoRA-base reference is the base model exactly, the
example learns, a run resumes under another layout exactly, and the settings that cannot stand together are refused
in one line. (Layout parity: tests/test_parity.py's *_dpo, *_simpo, *_orpo rows; TRL: tests/test_trl_equality.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_main
from preference_fixture import EXAMPLE, example_files, write_preference_jsonl

from meshtron.config import LoraConfig, load_config
from meshtron.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_adapters_off_is_the_base_model_exactly():
    """``lora_base``: the policy with its adapters' scaling at 0 computes the base model's logits bit for bit, and
    the adapters are back on after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshtron.models.adapter import adapter_for
    from meshtron.models.lora import add_lora
    from meshtron.train.preference.reference import adapters_off

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base = LlamaForCausalLM(config).eval()
    adapted = LlamaForCausalLM(config).eval()
    adapted.load_state_dict(base.state_dict())
    add_lora(adapted, adapter_for(config), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:  # trained adapters: nonzero
                parameter.normal_()
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        expected = base(ids).logits
        with adapters_off([adapted]):
            off = adapted(ids).logits
        on = adapted(ids).logits
    assert torch.equal(off, expected)
    assert not torch.allclose(on, expected)


def test_the_example_files_are_what_the_fixture_makes():
    """examples/preference/ (configs/sft-for-dpo.toml, configs/dpo.toml) holds exactly what
    tests/preference_fixture.py writes (regenerate: ``python tests/preference_fixture.py``)."""
    for name, text in example_files().items():
        assert (EXAMPLE / name).read_text() == text, f"examples/preference/{name} is stale"


@pytest.mark.slow
def test_the_example_learns_from_an_sft_checkpoint(tmp_path):
    """configs/sft-for-dpo.toml, exported, then configs/dpo.toml (10 of its 20 steps): the held-out pairs'
    rewards/accuracies reaches 0.9 (1.0 measured at step 10 on 2026-11-28, from 0 at the start)."""
    sft, model, dpo = tmp_path / "sft", tmp_path / "model", tmp_path / "dpo"
    common = [f"--data.cache_dir={tmp_path / 'cache'}", "--run.progress=false"]
    done = run_main(["train", "--config", str(REPO / "configs/sft-for-dpo.toml"), f"--run.output_dir={sft}", *common])
    assert done.returncode == 0, done.stderr[-3000:]
    exported = run_main(["export", str(sft / "checkpoints/step-00000030"), str(model)])
    assert exported.returncode == 0, exported.stderr[-3000:]
    overrides = [f"--model.name_or_path={model}", f"--run.output_dir={dpo}", "--train.steps=10", *common]
    done = run_main(["train", "--config", str(REPO / "configs/dpo.toml"), *overrides])
    assert done.returncode == 0, done.stderr[-3000:]
    evaluations = [row for row in _rows(dpo) if "eval_rewards/accuracies" in row]
    assert evaluations and evaluations[-1]["step"] == 10
    assert evaluations[-1]["eval_rewards/accuracies"] >= 0.9, evaluations[-1]
    assert evaluations[-1]["eval_rewards/margins"] > 0
    # meshtron plot reads TRL's metric (a panel of its own) from the run.
    from meshtron.metrics.runs import read_run

    assert read_run(dpo).column("rewards/accuracies")[-1] >= 0.9
    drawn = run_main(["plot", str(dpo), "--out", str(tmp_path / "curves.png")])
    assert drawn.returncode == 0 and (tmp_path / "curves.png").stat().st_size > 0, drawn.stderr[-2000:]


DPO_RUN = [
    "--model.preset=llama-tiny",
    "--train.objective=dpo",
    "--dpo.beta=0.5",
    "--data.format=preference",
    "--data.seq_len=32",
    "--train.global_batch_size=8",
    "--train.steps=4",
    "--optimizer.lr=3e-3",
    "--schedule.warmup_steps=1",
    "--run.progress=false",
]


@pytest.mark.slow
def test_a_dpo_run_resumes_under_another_layout_exactly(tmp_path):
    """One process to step 2 (checkpointed), then FSDP on 2 processes from that checkpoint: steps 3 and 4 have the
    uninterrupted one-process run's losses and metrics (the reference copy rebuilt from the starting weights)."""
    data = write_preference_jsonl(tmp_path / "pairs.jsonl", 40, "upper")
    run = [*DPO_RUN, f"--data.path={data}", "--checkpoint.interval=2"]
    whole = run_main(["train", *run, f"--run.output_dir={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-00000002"
    resumed = run_cli(
        ["train", "--nproc", "2", *run, f"--run.output_dir={tmp_path / 'resumed'}", f"--checkpoint.resume={checkpoint}"]
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    expected = {row["step"]: row for row in _rows(tmp_path / "whole") if "loss" in row}
    got = {row["step"]: row for row in _rows(tmp_path / "resumed") if "loss" in row}
    assert sorted(got) == [3, 4]
    for step, row in got.items():
        for key in ("loss", "rewards/chosen", "rewards/margins", "logps/rejected"):
            assert row[key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
    # meshtron eval on a preference set: the objective's loss and TRL's metrics, its accuracy in the last line.
    evaluated = run_main(["eval", str(checkpoint), f"--eval.path={data}", f"--run.output_dir={tmp_path / 'eval'}"])
    assert evaluated.returncode == 0 and "rewards/accuracies" in evaluated.stdout, evaluated.stderr[-3000:]
    (row,) = [row for row in _rows(tmp_path / "eval") if "eval_loss" in row]
    assert 0 < row["eval_loss"] < 1 and 0 <= row["eval_rewards/accuracies"] <= 1


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["data.format=preference"], "data.format=preference"),
        (["train.objective=dpo"], "train.objective=dpo"),
        (["dpo.beta=0.5"], "dpo.beta"),
        (["train.objective=ipo", "data.format=preference", "dpo.beta=0.5"], "dpo.beta"),
        (["preference.max_length=100"], "preference.max_length"),
        (["train.objective=simpo", "data.format=preference", "preference.reference=model"], "reference-free"),
        (["train.objective=orpo", "data.format=preference", "preference.reference_dtype=bfloat16"], "reference-free"),
        (["train.objective=dpo", "data.format=preference", "preference.reference=lora_base"], "lora.rank"),
        (["train.objective=dpo", "data.format=preference", "dpo.label_smoothing=0.1"], "dpo.loss_type=robust"),
        (["train.objective=dpo", "data.format=preference", "dpo.beta=0"], "dpo.beta"),
    ],
)
def test_settings_that_cannot_stand_together_are_refused_in_one_line(overrides, named):
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides, env={})
    message = str(refused.value)
    assert named in message and "\n" not in message
