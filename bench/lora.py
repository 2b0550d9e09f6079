"""LoRA vs full fine-tuning (``[lora]``), and vs peft + the Hugging Face Trainer: step time and peak memory.

Each cell is one ``meshtron train`` run (bench/optimizer.py's runner: median step time after the warm-up steps, and
the peak ``max_memory_gb`` of metrics.jsonl, the process's resident memory on CPU); rounds alternate which of the
two runs first. For the one-process layout, each round also runs peft + the Hugging Face Trainer on the same model,
LoRA settings, sequence length and batch (bench/peft_trainer.py), in the same alternating order. Example:

    python bench/lora.py                                   # llama-small, rank 16, 1 process, FSDP2, TP2; 2 rounds
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from optimizer import bench_parser, compare


def run_peft_trainer(layout: str, args) -> tuple[float, float] | None:
    """(median s/step, peak GB) of bench/peft_trainer.py with the same settings, one thread as meshtron's runs (one
    process only: None for the other layouts)."""
    if layout != "single":
        return None
    command = [
        sys.executable,
        str(Path(__file__).with_name("peft_trainer.py")),
        f"--preset={args.preset}",
        f"--seq-len={args.seq_len}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--rank={args.rank}",
    ]
    proc = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1200
    )
    if proc.returncode != 0:
        raise SystemExit(f"peft + Trainer failed:\n{proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["seconds"], result["max_memory_gb"]


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    variants = {
        "full": [],
        "lora": [f"--lora.rank={args.rank}", f"--lora.alpha={2 * args.rank}"],
        "peft": run_peft_trainer,
    }
    results = compare(variants, args)
    print(
        f"{args.preset}, seq {args.seq_len}, global batch {args.batch}, LoRA rank {args.rank}, {args.rounds} round(s)"
    )
    print(f"{'layout':<8} {'full s/step':>12} {'lora s/step':>12} {'lora / full':>12} {'full GB':>8} {'lora GB':>8}")
    for layout in args.layouts:
        full, lora = (results[(layout, name)] for name in ("full", "lora"))
        seconds = [statistics.median(s for s, _ in runs) for runs in (full, lora)]
        memory = [max(m for _, m in runs) for runs in (full, lora)]
        print(
            f"{layout:<8} {seconds[0]:>12.3f} {seconds[1]:>12.3f} {seconds[1] / seconds[0]:>12.2f} "
            f"{memory[0]:>8.2f} {memory[1]:>8.2f}"
        )
    if ("single", "peft") in results:
        peft, lora = results[("single", "peft")], results[("single", "lora")]
        seconds, memory = statistics.median(s for s, _ in peft), max(m for _, m in peft)
        lora_seconds = statistics.median(s for s, _ in lora)
        print(
            f"peft + HF Trainer, 1 process: {seconds:.3f} s/step, {memory:.2f} GB "
            f"(meshtron LoRA / peft: {lora_seconds / seconds:.2f}x time); per round: "
            + ", ".join(f"{a:.3f} / {b:.3f}" for (a, _), (b, _) in zip(lora, peft))
        )


if __name__ == "__main__":
    main()
