"""meshtron's preference objectives equal TRL 1.16's trainers end to end (issue 59's first acceptance item).

For each objective (DPO sigmoid, robust with label_smoothing, RPO's NLL term; IPO; SimPO with and without
cpo_alpha; ORPO), a tiny Llama and a tiny Qwen3 saved with ``save_pretrained`` (tests/chat_fixture.py's character
tokenizer and chat template), plain-string and conversational pairs: ``meshtron train`` (one process, fp32, CPU) and
TRL's trainer (DPOTrainer, CPOTrainer, ORPOTrainer) train on the same 8 pairs, all of them in each of 3 optimizer
steps, with the same AdamW settings and a constant learning rate. Their first step's loss and every metric meshtron
logs (``rewards/*``, ``logps/*``, SimPO's and ORPO's ``nll_loss``, ORPO's log odds) agree within 1e-5 relative, and
so does every weight after the 3 steps. CPOTrainer and ORPOTrainer tokenize in their older way: the test checks that
on these pairs their token ids and completion masks are meshtron's (docs/post-training.md says where they differ).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_fixture import CHAT_MODEL, write_chat_fixture
from conftest import run_main
from preference_fixture import preference_records

PAIRS = 8
SEQ_LEN = 80
MAX_LENGTH = (SEQ_LEN + 1) // 2 - 1  # meshtron's resolved preference.max_length, TRL's max_length
LR = 1e-4
STEPS = 3
RTOL = 1e-5
ATOL = 1e-6
"""Added to a metric's bound: a few of them are differences of nearly equal terms (ORPO's ``log_odds_chosen``, the
margins), whose fp32 rounding (~1e-7 on log-probabilities near -5) is large relative to their value."""
QWEN3_MODEL = "chat-qwen3"


@dataclass(frozen=True)
class Case:
    """One objective's settings in meshtron (``--section.key=value``) and in TRL (its trainer and config)."""

    name: str
    objective: str
    model: str
    conversational: bool
    meshtron: dict = field(default_factory=dict)
    trainer: str = "dpo"
    trl: dict = field(default_factory=dict)


CASES = [
    Case("dpo-sigmoid", "dpo", CHAT_MODEL, False, {"dpo.beta": 0.1}, "dpo", {"beta": 0.1, "loss_type": ["sigmoid"]}),
    Case(
        "dpo-robust",
        "dpo",
        QWEN3_MODEL,
        True,
        {"dpo.beta": 0.2, "dpo.loss_type": "robust", "dpo.label_smoothing": 0.2},
        "dpo",
        {"beta": 0.2, "loss_type": ["robust"], "label_smoothing": 0.2},
    ),
    Case(
        "dpo-rpo",
        "dpo",
        CHAT_MODEL,
        True,
        {"dpo.beta": 0.1, "dpo.rpo_alpha": 0.5},
        "dpo",
        {"beta": 0.1, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    ),
    Case("ipo", "ipo", QWEN3_MODEL, False, {"ipo.beta": 0.3}, "dpo", {"beta": 0.3, "loss_type": ["ipo"]}),
    Case(
        "simpo",
        "simpo",
        CHAT_MODEL,
        False,
        {"simpo.beta": 2.0, "simpo.gamma": 0.5, "simpo.cpo_alpha": 0.0},
        "cpo",
        {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
    ),
    Case(
        "simpo-cpo-alpha",
        "simpo",
        QWEN3_MODEL,
        True,
        {"simpo.beta": 2.0, "simpo.gamma": 0.5, "simpo.cpo_alpha": 0.7},
        "cpo",
        {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.7},
    ),
    Case("orpo", "orpo", CHAT_MODEL, True, {"orpo.beta": 0.1}, "orpo", {"beta": 0.1}),
    Case("orpo-qwen3", "orpo", QWEN3_MODEL, False, {"orpo.beta": 0.2}, "orpo", {"beta": 0.2}),
]


def save_tiny_qwen3(target: Path, tokenizer_folder: Path) -> None:
    """A two-layer Qwen3 of the chat fixture's vocabulary, with its tokenizer, saved with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.save_pretrained(target)
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    with torch.random.fork_rng():
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(config).save_pretrained(target)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The two models and both forms of the pairs (``plain.jsonl``, ``conversational.jsonl``)."""
    directory = tmp_path_factory.mktemp("trl-equality")
    write_chat_fixture(directory)
    save_tiny_qwen3(directory / QWEN3_MODEL, directory / CHAT_MODEL)
    for conversational in (False, True):
        records = preference_records(PAIRS, "upper", conversational)
        (directory / _data_name(conversational)).write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _data_name(conversational: bool) -> str:
    return "conversational.jsonl" if conversational else "plain.jsonl"


def run_meshtron(case: Case, folder: Path, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """meshtron's first metrics row and its weights after ``STEPS`` steps (checkpointed, then exported)."""
    from safetensors.torch import load_file

    settings = {
        "model.name_or_path": folder / case.model,
        "train.objective": case.objective,
        "data.format": "preference",
        "data.path": folder / _data_name(case.conversational),
        "data.seq_len": SEQ_LEN,
        "data.shuffle": "false",
        "train.steps": STEPS,
        "train.global_batch_size": PAIRS,
        "train.micro_batch_size": PAIRS,
        "optimizer.lr": LR,
        "optimizer.beta1": 0.9,
        "optimizer.beta2": 0.999,
        "optimizer.eps": 1e-8,
        "optimizer.weight_decay": 0.0,
        "optimizer.max_grad_norm": 1.0,
        "schedule.kind": "constant",
        "schedule.warmup_steps": 0,
        "precision.mixed_precision": "none",
        "checkpoint.interval": STEPS,
        "run.output_dir": out,
        **case.meshtron,
    }
    trained = run_main(["train", *(f"--{key}={value}" for key, value in settings.items())])
    assert trained.returncode == 0, trained.stdout + trained.stderr
    checkpoint = out / "checkpoints" / f"step-{STEPS:08d}"
    exported = run_main(["export", str(checkpoint), str(out / "export")])
    assert exported.returncode == 0, exported.stdout + exported.stderr
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    return first, load_file(out / "export" / "model.safetensors")


def _trl_trainer(case: Case, folder: Path, out: Path):
    """TRL's trainer for ``case`` on the same pairs, model and optimizer settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=PAIRS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's configs default to bf16 where the device has it, the CPU included
        seed=0,
        disable_dropout=True,
        max_length=MAX_LENGTH,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder / case.model)
    model = AutoModelForCausalLM.from_pretrained(folder / case.model, dtype=torch.float32)
    dataset = Dataset.from_list(preference_records(PAIRS, "upper", case.conversational))
    if case.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, **case.trl)
        return DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # CPOTrainer and ORPOTrainer pad with it (masked out)
    if case.trainer == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, **case.trl)
        return CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(**common, **case.trl)
    return ORPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)


def run_trl(case: Case, folder: Path, out: Path):
    """TRL's first logged row, its weights after ``STEPS`` steps and its tokenized dataset."""
    trainer = _trl_trainer(case, folder, out)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["step"] == 1
    weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    return first, weights, trainer.train_dataset


def assert_same_tokens(trl_rows, folder: Path, case: Case) -> None:
    """CPOTrainer's and ORPOTrainer's token ids and completion masks (their older tokenization) equal meshtron's
    rows on these pairs: each sequence's ids, and which targets are the answer's."""
    from meshtron.config import DataConfig, PreferenceConfig
    from meshtron.data.preference import build_preference_datasets
    from meshtron.data.tokenizer import load_tokenizer

    data = DataConfig(format="preference", path=str(folder / _data_name(case.conversational)), seq_len=SEQ_LEN)
    dataset, _ = build_preference_datasets(data, PreferenceConfig(), load_tokenizer(str(folder / case.model)))
    assert len(dataset) == len(trl_rows) == PAIRS
    for row, record in enumerate(trl_rows):
        starts = {"chosen": 0, "rejected": int(dataset.chosen_end[row])}
        for answer, start in starts.items():
            ids, labels = record[f"{answer}_input_ids"], np.asarray(record[f"{answer}_labels"])
            assert len(ids) < MAX_LENGTH  # nothing cut: TRL's older truncation never ran
            assert dataset.tokens[row, start : start + len(ids)].tolist() == ids
            assert dataset.tokens[row, start + len(ids)] == dataset.separator
            assert dataset.trained[row, start + 1 : start + len(ids)].tolist() == (labels[1:] != -100).tolist()


def _close(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= RTOL * abs(theirs) + ATOL


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_first_step_metrics_and_weights_after_three_steps_equal_trls(case, folder, tmp_path):
    ours, our_weights = run_meshtron(case, folder, tmp_path / "meshtron")
    theirs, their_weights, trl_rows = run_trl(case, folder, tmp_path / "trl")
    if case.trainer != "dpo":  # DPOTrainer's tokenization is meshtron's (tests/test_preference_data.py)
        assert_same_tokens(trl_rows, folder, case)

    names = ["loss", *(name for name in ours if "/" in name or name.startswith(("nll", "log_odds")))]
    assert "rewards/margins" in names and "logps/chosen" in names
    assert case.objective not in ("simpo", "orpo") or "nll_loss" in names
    assert case.objective != "orpo" or {"log_odds_ratio", "log_odds_chosen"} <= set(names)
    differences = {name: (ours[name], theirs[name]) for name in names if not _close(ours[name], theirs[name])}
    assert not differences, f"{case.name}: first-step metrics (meshtron, TRL) differ: {differences}"
    assert math.isfinite(ours["loss"])

    start = _start_weights(folder / case.model)
    assert set(our_weights) == set(their_weights)
    for name, theirs_tensor in their_weights.items():
        ours_tensor = our_weights[name]
        relative = float((ours_tensor - theirs_tensor).norm() / theirs_tensor.norm())
        largest = float((ours_tensor - theirs_tensor).abs().max())
        assert relative < RTOL and largest < RTOL, f"{case.name}: {name} rel L2 {relative:.2e}, max abs {largest:.2e}"
    moved = max(float((their_weights[name] - start[name]).abs().max()) for name in start)
    assert moved > 10 * RTOL  # the 3 steps moved the weights far more than the bound


def _start_weights(model_folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_folder / "model.safetensors")
