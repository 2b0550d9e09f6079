"""LoRA vs full fine-tuning (``[lora]``): step time and peak memory of the same training run, per layout, on CPU.

Each cell is one ``meshtron train`` run (bench/optimizer.py's runner: median step time after the warm-up steps, and
the peak ``max_memory_gb`` of metrics.jsonl, the process's resident memory on CPU); rounds alternate which of the
two runs first. Example:

    python bench/lora.py                                   # llama-small, rank 16, 1 process, FSDP2, TP2; 2 rounds
"""

from __future__ import annotations

import statistics

from optimizer import bench_parser, compare


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    variants = {"full": [], "lora": [f"--lora.rank={args.rank}", f"--lora.alpha={2 * args.rank}"]}
    results = compare(variants, args)
    print(
        f"{args.preset}, seq {args.seq_len}, global batch {args.batch}, LoRA rank {args.rank}, {args.rounds} round(s)"
    )
    print(f"{'layout':<8} {'full s/step':>12} {'lora s/step':>12} {'lora / full':>12} {'full GB':>8} {'lora GB':>8}")
    for layout in args.layouts:
        full, lora = (results[(layout, name)] for name in variants)
        seconds = [statistics.median(s for s, _ in runs) for runs in (full, lora)]
        memory = [max(m for _, m in runs) for runs in (full, lora)]
        print(
            f"{layout:<8} {seconds[0]:>12.3f} {seconds[1]:>12.3f} {seconds[1] / seconds[0]:>12.2f} "
            f"{memory[0]:>8.2f} {memory[1]:>8.2f}"
        )


if __name__ == "__main__":
    main()
