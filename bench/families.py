"""The model families whose attention or routing is meshtron's own on a device: the CPU's losses, and their speed.

For each preset (default: Gemma 2, DeepSeek-V3, gpt-oss when meshtron has it) it trains ``--steps`` steps in fp32
with document masks on, i.e. through meshtron's attention (on CUDA: compiled FlexAttention with Gemma 2's soft cap,
DeepSeek-V3's values narrower than its keys, gpt-oss's sinks; on CPU: SDPA or the eager math), once on the CPU and
once on ``--device``, and compares the per-step losses: they must agree to ``--rtol`` (fp32 kernels reduce in other
orders and AdamW amplifies it, so not bit for bit; a wrong mask, cap or sink is off by far more). Then
``--speed-steps`` steps in bf16 on the device give tokens/s, MFU (meshtron's own figure, against the device's dense
bf16 peak) and peak memory.

Exit status 1 when a comparison fails. Example (on a GPU machine):

    python bench/families.py --device cuda
    python bench/families.py --device cuda --presets deepseekv3-tiny --seq-len 1024 --speed-steps 20
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

from meshtron.models.presets import PRESETS

DEFAULT_PRESETS = [name for name in ("gemma2-tiny", "deepseekv3-tiny", "gptoss-tiny") if name in PRESETS]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="fp32 steps compared with the CPU (0: speed only)")
    p.add_argument("--speed-steps", type=int, default=0, help="bf16 steps on the device after the check (0: none)")
    # On an H200 the control (llama-tiny) drifts to 3.6e-5 over 6 fp32 steps and the MoE presets to 1.2e-4 (routing
    # near ties); a wrong mask, cap or sink is off by 1e-2 or more (BENCHMARKS.md).
    p.add_argument("--rtol", type=float, default=1e-3)
    return p.parse_args(argv)


def train(preset: str, device: str, steps: int, out: Path, args, extra=()) -> list[dict]:
    """The metrics.jsonl rows of one single-process ``meshtron train`` run."""
    command = [
        sys.executable,
        "-m",
        "meshtron",
        "train",
        f"--model.preset={preset}",
        f"--data.seq_len={args.seq_len}",
        "--data.max_documents=400",
        f"--train.global_batch_size={args.batch}",
        f"--train.steps={steps}",
        "--schedule.warmup_steps=1",
        f"--run.device={device}",
        "--run.progress=false",
        f"--run.output_dir={out}",
        *extra,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{preset} on {device} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def main(argv=None) -> int:
    args = parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            if args.steps == 0:  # speed only
                cpu = dev = []
            else:
                cpu = [row["loss"] for row in train(preset, "cpu", args.steps, Path(tmp) / f"{preset}-cpu", args)]
                dev = [row["loss"] for row in train(preset, args.device, args.steps, Path(tmp) / f"{preset}-d", args)]
            if cpu:
                worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, dev))
                passed = len(cpu) == len(dev) == args.steps and worst <= args.rtol
                ok &= passed
                print(
                    f"{preset}: fp32 losses cpu {cpu[0]:.6f} -> {cpu[-1]:.6f}, "
                    f"{args.device} {dev[0]:.6f} -> {dev[-1]:.6f}; "
                    f"worst relative difference {worst:.2e} over {len(dev)} steps: {'PASS' if passed else 'FAIL'}"
                )
            if args.speed_steps:
                rows = train(
                    preset,
                    args.device,
                    args.speed_steps,
                    Path(tmp) / f"{preset}-speed",
                    args,
                    ["--precision.mixed_precision=bf16"],
                )
                timed = rows[len(rows) // 2 :]  # the second half: past compilation and warm-up
                mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]  # none on a CPU (no known peak)
                mfu = f"MFU {statistics.median(mfus):.1%}, " if mfus else ""
                print(
                    f"{preset} bf16 on {args.device}: "
                    f"{statistics.median(r['tokens_per_s'] for r in timed):,.0f} tokens/s, "
                    f"{mfu}peak {max(r['max_memory_gb'] for r in rows):.2f} GB (median of the last {len(timed)} steps)"
                )
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
