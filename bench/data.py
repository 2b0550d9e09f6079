"""Data preparation: tokens/s of `meshtron data prepare` with 1 and 2 workers (byte and a BPE tokenizer), its peak
memory, and the time to the first training step from a prepared corpus vs the same corpus read on the fly;
streaming (data.streaming): tokens/s one data-parallel rank gets from its lanes, and the time to the first step.

The corpus is generated (random words as JSON lines, the generator of tests/test_prepare.py); the BPE tokenizer
is trained here with `tokenizers` on a slice of it. Nothing is downloaded.

    python bench/data.py                     # 200 MB corpus for the byte tokenizer, 100 MB for BPE
    python bench/data.py --mb 50 --bpe-mb 10
    python bench/data.py --mb 50 --bpe-mb 20 --streaming-only
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from test_prepare import generate_corpus  # noqa: E402 - the tests' generator, so that both measure the same text


def train_bpe(corpus: Path, out: Path, vocab_size: int = 8000) -> Path:
    """A byte-level BPE tokenizer trained on the first 5 MB of ``corpus``, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    with corpus.open() as lines:
        for line in lines:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size > 5e6:
                break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(out)
    return out


def prepare(source: Path, out: Path, tokenizer: str, workers: int, shard_mb: float) -> dict:
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtron",
            "data",
            "prepare",
            f"--data.path={source}",
            f"--data.tokenizer={tokenizer}",
            f"--out={out}",
            f"--workers={workers}",
            f"--shard-mb={shard_mb}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(proc.stdout + proc.stderr)
    peak = re.search(r"peak memory (\d+) MB in this process, (\d+) MB in the largest worker", proc.stdout)
    tokens = json.loads((out / "manifest.json").read_text())["tokens"]
    return {"seconds": seconds, "tokens": tokens, "main_mb": int(peak[1]), "worker_mb": int(peak[2])}


def first_step_seconds(data_path: Path, tokenizer: str, cache_dir: Path, out: Path) -> float:
    """Wall seconds of a one-step training run (start-up, data, one step) in one process."""
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtron",
            "train",
            "--model.preset=llama-tiny",
            "--train.steps=1",
            f"--data.path={data_path}",
            f"--data.tokenizer={tokenizer}",
            f"--data.cache_dir={cache_dir}",
            "--data.seq_len=256",
            "--run.progress=false",
            f"--run.output_dir={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(proc.stdout + proc.stderr)
    return time.perf_counter() - started


def first_step_streaming_seconds(data_path: Path, tokenizer: str, out: Path) -> float:
    """Wall seconds of a one-step training run that streams ``data_path`` (data.streaming)."""
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtron",
            "train",
            "--model.preset=llama-tiny",
            "--train.steps=1",
            f"--data.path={data_path}",
            f"--data.tokenizer={tokenizer}",
            "--data.streaming=true",
            "--data.seq_len=256",
            "--run.progress=false",
            f"--run.output_dir={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(proc.stdout + proc.stderr)
    return time.perf_counter() - started


def streamed_tokens_per_s(
    source: Path, tokenizer: str, ranks: int, batches: int = 40, global_batch: int = 64, seq_len: int = 1024
) -> float:
    """Tokens/s that one of ``ranks`` data-parallel ranks gets from a stream (its lanes of each global batch)."""
    from meshtron.config import DataConfig
    from meshtron.data.streaming import StreamingDataset
    from meshtron.data.tokenizer import load_tokenizer

    dataset = StreamingDataset(DataConfig(path=str(source), seq_len=seq_len), load_tokenizer(tokenizer), global_batch)
    lanes = list(range(global_batch // ranks))
    dataset.own(lanes)
    dataset.rows(lanes)  # opening the stream is start-up, not throughput
    started = time.perf_counter()
    for n in range(1, batches + 1):
        dataset.rows([n * global_batch + j for j in lanes])
    return batches * len(lanes) * seq_len / (time.perf_counter() - started)


def streaming_tables(corpus: Path, bpe_corpus: Path, bpe: Path, work: Path) -> None:
    print("\nStreaming (data.streaming), one rank reading its lanes of 40 global batches of 64 x 1024 tokens:\n")
    print("| tokenizer | data-parallel ranks | tokens/s of this rank | global tokens/s if every rank does as well |")
    print("|---|---|---|---|")
    for name, source, tokenizer in (("byte", corpus, "byte"), ("BPE 8k", bpe_corpus, str(bpe))):
        for ranks in (1, 2, 4):
            rate = streamed_tokens_per_s(source, tokenizer, ranks)
            print(f"| {name} | {ranks} | {rate:,.0f} | {rate * ranks:,.0f} |", flush=True)
    print("\nOne-step training run streaming the corpus (llama-tiny, seq_len 256, 1 process), seconds:\n")
    print("| tokenizer | seconds |")
    print("|---|---|")
    for name, source, tokenizer in (("byte", corpus, "byte"), ("BPE", bpe_corpus, str(bpe))):
        print(
            f"| {name} | {first_step_streaming_seconds(source, tokenizer, work / f'run-{name}-stream'):.1f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200, help="corpus size for the byte tokenizer (MB)")
    parser.add_argument("--bpe-mb", type=float, default=100, help="corpus size for the BPE tokenizer (MB)")
    parser.add_argument("--shard-mb", type=float, default=8, help="prepare's --shard-mb")
    parser.add_argument("--streaming-only", action="store_true", help="measure data.streaming only")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshtron-bench-data-"))
    corpus, bpe_corpus = (
        generate_corpus(work / "corpus.jsonl", args.mb),
        generate_corpus(work / "bpe.jsonl", args.bpe_mb, 1),
    )
    bpe = train_bpe(bpe_corpus, work / "bpe-tokenizer")
    if args.streaming_only:
        streaming_tables(corpus, bpe_corpus, bpe, work)
        return
    print(f"--shard-mb {args.shard_mb:g}\n")
    print("| tokenizer | corpus MB | workers | tokens | seconds | tokens/s | peak MB (main / largest worker) |")
    print("|---|---|---|---|---|---|---|")
    for name, source, tokenizer, megabytes in (
        ("byte", corpus, "byte", args.mb),
        ("BPE 8k", bpe_corpus, str(bpe), args.bpe_mb),
    ):
        for workers in (1, 2):
            got = prepare(source, work / f"{name.split()[0]}-{workers}", tokenizer, workers, args.shard_mb)
            print(
                f"| {name} | {megabytes:g} | {workers} | {got['tokens']:,} | {got['seconds']:.1f} | "
                f"{got['tokens'] / got['seconds']:,.0f} | {got['main_mb']} / {got['worker_mb']} |",
                flush=True,
            )
    print("\nOne-step training run (llama-tiny, seq_len 256, 1 process), seconds from start to finish:\n")
    print("| data | tokenizer | prepared | on the fly, first run (tokenizes into the cache) | on the fly, cache warm |")
    print("|---|---|---|---|---|")
    for name, source, tokenizer, megabytes in (
        ("byte", corpus, "byte", args.mb),
        ("BPE", bpe_corpus, str(bpe), args.bpe_mb),
    ):
        key = name.split()[0]
        prepared = first_step_seconds(work / f"{key}-1", tokenizer, work / "unused-cache", work / f"run-{key}-prepared")
        cold = first_step_seconds(source, tokenizer, work / f"cache-{key}", work / f"run-{key}-cold")
        warm = first_step_seconds(source, tokenizer, work / f"cache-{key}", work / f"run-{key}-warm")
        print(f"| {megabytes:g} MB | {name} | {prepared:.1f} | {cold:.1f} | {warm:.1f} |", flush=True)
    streaming_tables(corpus, bpe_corpus, bpe, work)


if __name__ == "__main__":
    main()
