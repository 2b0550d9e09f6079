"""``bench/dpo_throughput.py`` (meshtron's DPO against TRL's DPOTrainer) on CPU: its meshtron runner end to end as
the GPU call starts it (``--tiny``), and its TRL runner fed exactly the tokens meshtron trains on, so that the GPU
run, which has one try, finds no typo and compares like with like."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, worker_env


@pytest.fixture(scope="module")
def bench():
    """``bench/dpo_throughput.py`` as a module; no top-level name left behind."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "bench"))
        try:
            yield importlib.import_module("dpo_throughput")
        finally:
            for name in ("dpo_throughput", "throughput", "peers"):
                sys.modules.pop(name, None)


def test_tiny_meshtron_runner_measures_dpo_pairs(tmp_path):
    """Four DPO steps of llama-tiny through ``meshtron train``: pairs/s and tokens/s (two sequences of prompt 24 +
    answer 16 tokens a pair) from its metrics, and the first loss log 2 (the reference is the starting policy)."""
    out = tmp_path / "dpo.json"
    command = [sys.executable, "bench/dpo_throughput.py", "--tiny", "--runners", "meshtron", "--json", str(out)]
    proc = subprocess.run(command, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["meta"]["meshtron_seq_len"] == 2 * (24 + 16 + 1)
    [result] = report["results"]
    assert result["runner"] == "meshtron" and result["batch"] == 2, result
    assert result["pairs_per_s"] > 0, result
    assert result["tokens_per_s"] == pytest.approx(result["pairs_per_s"] * 2 * (24 + 16))
    assert result["loss_first"] == pytest.approx(math.log(2), abs=1e-6)
    assert "| meshtron | 2 |" in proc.stdout


def test_trl_runner_gets_the_tokens_meshtron_trains_on(bench):
    """TRL's own preparation of the bench's pairs (DPOTrainer._prepare_dataset, with the bench's tokenizer) gives
    meshtron's byte-tokenizer ids: the prompt's bytes, each answer's bytes then EOS, every sequence L tokens."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DPOTrainer

    from meshtron.data.tokenizer import ByteTokenizer

    records = bench.pair_records(3, prompt_tokens=7, answer_tokens=5)
    tokenizer = bench.byte_tokenizer()
    settings = SimpleNamespace(dataset_num_proc=None, max_length=12, truncation_mode="keep_start")
    prepared = DPOTrainer._prepare_dataset(
        SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list(records), tokenizer, settings, "train"
    )
    byte = ByteTokenizer()
    assert len(prepared) == len(records)
    for record, example in zip(records, prepared):
        assert record["chosen"] != record["rejected"]
        assert example["prompt_ids"] == byte.encode(record["prompt"]).tolist() and len(example["prompt_ids"]) == 7
        for answer in ("chosen", "rejected"):
            assert example[f"{answer}_ids"] == byte.encode(record[answer]).tolist() + [byte.eos_token_id]
            assert len(example["prompt_ids"] + example[f"{answer}_ids"]) == 12
