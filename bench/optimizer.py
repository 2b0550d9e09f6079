"""Muon vs AdamW (``optimizer.name``): step time and tokens/s of the same training run, per layout, on CPU.

Each cell is one ``meshtron train`` run (self-launched with ``--nproc`` for the multi-process layouts) of
``--steps`` steps of the preset on the builtin corpus; the figure is the median over the steps after the first
``--warmup`` of the step time (``tokens_per_s`` of metrics.jsonl turned back into seconds per step). Muon's extra
work is its Newton-Schulz iterations on every block matrix (in float32 on CPU) and, under FSDP and TP, the
all-gather of each matrix's update (meshtron/train/optim/muon.py). Rounds alternate the order of the optimizers.
Example:

    python bench/optimizer.py                                   # llama-small, 1 process, FSDP2, TP2; 2 rounds
    python bench/optimizer.py --layouts single --rounds 1 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "single": [],
    "fsdp2": ["--nproc", "2", "--parallel.dp_shard=2"],
    "tp2": ["--nproc", "2", "--parallel.tp=2", "--parallel.dp_shard=1"],
}


def run_steps(settings: list[str], layout: str, args, out: Path) -> tuple[float, float]:
    """(median seconds per optimizer step after the warm-up steps, peak memory GB) of one run with ``settings``."""
    command = [
        sys.executable,
        "-m",
        "meshtron",
        "train",
        *LAYOUTS[layout],
        f"--model.preset={args.preset}",
        f"--data.seq_len={args.seq_len}",
        "--data.max_documents=200",
        f"--train.global_batch_size={args.batch}",
        f"--train.steps={args.steps}",
        *settings,
        "--run.device=cpu",
        "--run.progress=false",
        f"--run.output_dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(settings)} / {layout} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = args.batch * args.seq_len
    seconds = statistics.median(tokens / row["tokens_per_s"] for row in rows[args.warmup :])
    return seconds, max(row["max_memory_gb"] for row in rows)


def bench_parser(description: str) -> argparse.ArgumentParser:
    """The settings every comparison of two runs per layout takes (bench/optimizer.py, bench/lora.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default="llama-small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    return parser


def compare(variants: dict, args) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """{(layout, variant): [(s/step, peak GB) per round]} of every variant under every layout; rounds alternate
    which variant runs first. A variant is ``meshtron train`` settings, or a function ``(layout, args)`` that runs
    something else and returns (s/step, peak GB), or None where it has no such layout."""
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for layout in args.layouts:
                for name in order:
                    variant = variants[name]
                    if callable(variant):
                        result = variant(layout, args)
                    else:
                        result = run_steps(variant, layout, args, Path(tmp) / f"{layout}-{name}-{round_index}")
                    if result is not None:
                        results.setdefault((layout, name), []).append(result)
    return results


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    results = compare({name: [f"--optimizer.name={name}"] for name in ("adamw", "muon")}, args)
    print(f"{args.preset}, seq {args.seq_len}, global batch {args.batch}, median s/step over {args.rounds} round(s)")
    print(f"{'layout':<8} {'adamw s/step':>13} {'muon s/step':>12} {'muon / adamw':>13}")
    for layout in args.layouts:
        adamw, muon = (statistics.median(s for s, _ in results[(layout, name)]) for name in ("adamw", "muon"))
        print(f"{layout:<8} {adamw:>13.3f} {muon:>12.3f} {muon / adamw:>13.2f}")


if __name__ == "__main__":
    main()
