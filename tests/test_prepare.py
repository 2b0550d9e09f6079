"""`meshtron data prepare`: sharded token files that do not depend on the number of workers, memory bounded
by the shard size (not the corpus), a killed prepare resumed per shard, machines sharing the work by parts."""

from __future__ import annotations

import filecmp
import json
import random
import re
from pathlib import Path

import pytest
from conftest import run_cli

from meshtron.config import DataConfig
from meshtron.data.prepare import prepare_corpus
from meshtron.data.shards import MANIFEST, TokenCorpus, check_prepared_tokenizer
from meshtron.errors import ConfigError

SHARD_MB = 8


def generate_corpus(path: Path, megabytes: int, seed: int = 0) -> Path:
    """JSON lines of random words, ~1.5 KB a document (no download)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    with open(path, "w") as out:
        size = 0
        while size < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 400)))}) + "\n"
            out.write(line)
            size += len(line)
    return path


def prepare(source: Path, out: Path, workers: int) -> tuple[float, str]:
    """Run the command; returns (peak MB of the prepare process, its output)."""
    proc = run_cli(
        ["data", "prepare", f"--data.path={source}", f"--out={out}", f"--workers={workers}", f"--shard-mb={SHARD_MB}"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    peak = re.search(r"peak memory (\d+) MB in this process, (\d+) MB in the largest worker", proc.stdout)
    return max(float(peak[1]), float(peak[2])), proc.stdout


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


@pytest.mark.slow
def test_one_and_two_workers_write_the_same_files_in_memory_bounded_by_the_shard(tmp_path):
    """A 200 MB corpus: 1 and 2 workers give byte-identical shards and manifests; the peak memory of the
    prepare (its own process or its largest worker) is the same for 50 MB and 200 MB within 20%, and far
    below what holding the corpus would take (the tokens alone are ~400 MB as uint16)."""
    big = generate_corpus(tmp_path / "big.jsonl", 200)
    small = generate_corpus(tmp_path / "small.jsonl", 50, seed=1)
    peaks = {}
    for name, source in (("big", big), ("small", small)):
        for workers in (1, 2):
            peaks[name, workers], said = prepare(source, tmp_path / f"{name}{workers}", workers)
    assert same_files(tmp_path / "big1", tmp_path / "big2") and same_files(tmp_path / "small1", tmp_path / "small2")
    manifest = json.loads((tmp_path / "big1" / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokens"] > 195_000_000 and len(manifest["shards"]) >= 20
    for workers in (1, 2):
        assert abs(peaks["big", workers] - peaks["small", workers]) <= 0.2 * peaks["small", workers], peaks
    assert max(peaks.values()) < 250, peaks  # MB; SHARD_MB of text in flight per worker + 1, plus Python
    corpus = TokenCorpus(tmp_path / "big2")
    first = json.loads(big.open().readline())["text"]
    assert (
        bytes(corpus.read(0, len(first)).astype("uint8")).decode() == first
        and corpus.read(len(first), len(first) + 1) == 256
    )


def test_a_killed_prepare_resumes_with_the_shards_it_completed(tmp_path, monkeypatch):
    from meshtron.data import prepare as prepare_module

    source = generate_corpus(tmp_path / "c.jsonl", 1)
    data = DataConfig(path=str(source))
    clean = prepare_corpus(data, tmp_path / "clean", shard_chars=100_000)
    real_write, written = prepare_module.write_shard, []

    def dies_at_shard_4(directory, index, *args):
        if index == 4:
            raise KeyboardInterrupt  # as a prepare stopped in the middle of shard 4
        written.append(index)
        return real_write(directory, index, *args)

    monkeypatch.setattr(prepare_module, "write_shard", dies_at_shard_4)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(data, tmp_path / "resumed", shard_chars=100_000)
    assert written == [0, 1, 2, 3] and not (tmp_path / "resumed" / MANIFEST).exists()
    monkeypatch.setattr(prepare_module, "write_shard", real_write)
    lines = []
    resumed = prepare_corpus(data, tmp_path / "resumed", shard_chars=100_000, log=lines.append)
    assert "4 already complete from an earlier run" in lines[0] and resumed == clean
    assert all(
        filecmp.cmp(tmp_path / "clean" / n, tmp_path / "resumed" / n, shallow=False)
        for n in (p.name for p in (tmp_path / "clean").iterdir())
    )
    # The same command once more only says it is prepared; other data or settings into that folder are refused.
    assert prepare_corpus(data, tmp_path / "resumed", shard_chars=100_000) == clean
    with pytest.raises(ConfigError, match="holds a corpus prepared from other data or settings"):
        prepare_corpus(data, tmp_path / "resumed", shard_chars=50_000)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is a folder with other files in it"):
        prepare_corpus(data, tmp_path / "notes")


def test_machines_share_the_work_by_parts_and_the_last_writes_the_manifest(tmp_path):
    source = generate_corpus(tmp_path / "c.jsonl", 1)
    data = DataConfig(path=str(source))
    whole = prepare_corpus(data, tmp_path / "whole", shard_chars=100_000)
    lines = []
    assert prepare_corpus(data, tmp_path / "parts", shard_chars=100_000, part=(1, 2), log=lines.append) is None
    assert "left to the other parts" in lines[-1]
    assert prepare_corpus(data, tmp_path / "parts", shard_chars=100_000, part=(0, 2)) == whole
    assert same_files(tmp_path / "whole", tmp_path / "parts")
    with pytest.raises(ConfigError, match="--part must be i/n"):
        prepare_corpus(data, tmp_path / "x", part=(2, 2))


def test_training_refuses_a_prepared_directory_of_another_tokenizer(tmp_path):
    source = generate_corpus(tmp_path / "c.jsonl", 0.01)
    prepare_corpus(DataConfig(path=str(source)), tmp_path / "prepared")

    class OtherTokenizer:
        name, vocab_size, eos_token_id = "/models/other", 300, 299

        class tok:  # noqa: N801 - stands in for a Hugging Face tokenizer
            @staticmethod
            def get_vocab():
                return {f"t{i}": i for i in range(300)}

    from meshtron.data.tokenizer import ByteTokenizer

    check_prepared_tokenizer(str(tmp_path / "prepared"), ByteTokenizer())
    with pytest.raises(
        ConfigError,
        match=r"was prepared with the tokenizer 'byte' \(vocabulary 257\), not "
        r"data.tokenizer='/models/other'",
    ):
        check_prepared_tokenizer(str(tmp_path / "prepared"), OtherTokenizer())
