"""How long ``meshtron train --dry-run`` takes for Llama-3-8B and 70B shapes at 8, 64 and 512 ranks, and
how its measured per-rank parameter bytes compare with ``meshtron plan``'s estimate.

Each case is one fresh ``python -m meshtron train --dry-run`` process, timed from start to exit
(Python start-up and the transformers import included), as a user would run it.

Example:

    python bench/dry_run.py                 # all six cases, rank 0 of each
    python bench/dry_run.py --rank last     # the last rank (the last pipeline stage holds the head)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (model preset, world size, layout overrides): layouts of the kind published runs of these sizes use.
CASES = [
    ("llama-8b", 8, ["--parallel.dp_shard=8"]),
    ("llama-8b", 64, ["--parallel.tp=2"]),
    ("llama-8b", 512, ["--parallel.pp=2", "--parallel.tp=4"]),
    ("llama-70b", 8, ["--parallel.tp=8"]),
    ("llama-70b", 64, ["--parallel.tp=8"]),
    ("llama-70b", 512, ["--parallel.pp=8", "--parallel.tp=8"]),
]
NUMBER = r"([0-9.]+) GB"


def run_case(preset: str, world: int, overrides: list[str], rank: int, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "meshtron",
        "train",
        "--dry-run",
        "--nproc",
        str(world),
        "--dry-run-rank",
        str(rank),
        f"--model.preset={preset}",
        "--data.seq_len=8192",
        f"--train.global_batch_size={world * 2}",
        f"--run.output_dir={out / f'{preset}-{world}'}",
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    measured = float(re.search(r"parameters " + NUMBER, proc.stdout).group(1))
    total = float(re.search(r"total " + NUMBER, proc.stdout).group(1))
    planned = float(re.search(r"for this rank: parameters " + NUMBER, proc.stdout).group(1))
    layout = re.search(r"\(([^)]*)\), pipeline", proc.stdout).group(1)
    return {
        "preset": preset,
        "world": world,
        "rank": rank,
        "layout": layout,
        "params_gb": measured,
        "state_gb": total,
        "planned_gb": planned,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", default="0", help="rank to build: a number or 'last' (default 0)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset, world, overrides in CASES:
            rank = world - 1 if args.rank == "last" else int(args.rank)
            rows.append(run_case(preset, world, overrides, rank, Path(tmp)))
            print(rows[-1], flush=True)
    print("\n| model | ranks | layout | rank | params GB/rank | params+grads+AdamW GB | planner params GB | wall s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['world']} | {r['layout']} | {r['rank']} | {r['params_gb']:.3f} | "
            f"{r['state_gb']:.3f} | {r['planned_gb']:.3f} | {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
