"""Recovery after a dead rank: seconds from the death to the next new step, and steps lost (CPU, gloo).

For each case, ``meshtron train --nproc P --max-restarts 1`` runs with one rank killed (SIGKILL, test-only
``MESHTRON_FAULT``) at the start of a chosen step, next to the same run uninterrupted. From the fault's
stderr line (its wall-clock time) and ``metrics.jsonl`` (each row's ``time``) it reports:

* workers back: from the death until the restarted rank 0 has built its model (the agent noticing, stopping
  the others, starting new workers, which import torch and transformers, join, build and shard the model);
* load + re-train: from there to the end of the first step not trained before (the checkpoint load, then
  the lost steps again);
* death -> new step: the sum, i.e. until training is where it was when the rank died, plus one step;
* whether the last row of every step equals the uninterrupted run's loss (exact on CPU).

Example:

    python bench/recovery.py                       # FSDP over 2 ranks and dp2 x tp2 over 4, two kill points each
    python bench/recovery.py --cases fsdp2 --interval 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {  # name -> (processes, parallel settings)
    "fsdp2": (2, ["--parallel.dp_shard=2"]),
    "dp2_tp2": (4, ["--parallel.dp_shard=2", "--parallel.tp=2"]),
}


def train(args, out: Path, nproc: int, layout: list[str], fault: str | None) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "meshtron",
        "train",
        "--nproc",
        str(nproc),
        "--max-restarts",
        "1",
        f"--model.preset={args.preset}",
        "--data.max_documents=200",
        f"--data.seq_len={args.seq_len}",
        f"--data.cache_dir={out.parent / 'cache'}",
        f"--train.steps={args.steps}",
        "--train.global_batch_size=8",
        "--schedule.warmup_steps=2",
        "--run.progress=false",
        f"--checkpoint.interval={args.interval}",
        f"--run.output_dir={out}",
        *layout,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    if fault:
        env["MESHTRON_FAULT"] = fault
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"meshtron train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_losses(table: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in table}


def measure(args, workdir: Path, name: str, kill_step: int) -> dict:
    nproc, layout = CASES[name]
    straight = workdir / f"{name}-straight"
    if not straight.exists():
        train(args, straight, nproc, layout, None)
    straight_rows = rows(straight)
    step_s = statistics.median(b["time"] - a["time"] for a, b in zip(straight_rows[1:], straight_rows[2:]))
    out = workdir / f"{name}-kill{kill_step}"
    proc = train(args, out, nproc, layout, f"kill:step={kill_step}:rank={nproc - 1}")
    died = float(re.search(r"killed at the start of step \d+ at time ([\d.]+)", proc.stderr)[1])
    lost = int(re.search(r"restart 1 of this run after a failure: .*; (\d+) step\(s\)", proc.stdout)[1])
    after = [row for row in rows(out) if row.get("restart") == 1]
    back = after[0]["time"] - after[0]["elapsed_s"]  # elapsed_s counts from the restarted logger's start
    new_step = next(row for row in after if row["step"] >= kill_step)
    return {
        "case": name,
        "ranks": nproc,
        "killed at step": kill_step,
        "steps lost": lost,
        "workers back s": back - died,
        "load + re-train s": new_step["time"] - back,
        "death -> new step s": new_step["time"] - died,
        "step s (uninterrupted)": step_s,
        "losses equal": last_losses(rows(out)) == last_losses(straight_rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--preset", default="llama-deep")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--interval", type=int, default=4, help="checkpoint interval")
    args = parser.parse_args()
    kill_steps = (args.interval + 1, args.interval + 3)  # right after a checkpoint, and two steps later
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            for kill_step in kill_steps:
                results.append(measure(args, Path(tmp), name, kill_step))
    columns = list(results[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for result in results:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in result.values()) + " |")
    print(
        f"\n{args.preset}, seq_len {args.seq_len}, checkpoint every {args.interval} steps; "
        f"bench ran {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
