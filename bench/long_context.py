"""Long context on one GPU (issue 46's targets): train a few steps at one long sequence per step and report tokens/s,
the peak GPU memory against the planner's, and what autograd kept on the GPU and in host memory.

Each target is one ``meshtron train`` run (a fresh process; ``fsdp.cpu_offload`` starts one worker of meshtron's
launcher), on the embedded default data, with the settings ``meshtron plan --max-seq-len`` names for it:

* ``llama8b-lora``: llama-8b extended with yarn rope scaling, its frozen base in bf16, LoRA rank 16, at ``--lora-len``
  tokens (ALST: 500K);
* ``llama8b-full``: llama-8b fully trained with its state in host memory (``fsdp.cpu_offload``) at ``--full-len``;
* ``llama1b-full``: llama-1b fully trained at ``--small-len`` tokens (target: 1M).

All use full activation checkpointing, activation offloading and 8 MLP tiles. The presets use meshtron's byte
tokenizer (257 entries), so the head and loss are smaller than Llama 3's 128K vocabulary (the fused loss keeps them
small either way).

Examples (on the GPU machine; ``--smoke`` runs a tiny stand-in on CPU to check the script):

    python bench/long_context.py --targets llama8b-lora llama1b-full --steps 3
    python bench/long_context.py --targets llama8b-lora --lora-len 262144 524288
    python bench/long_context.py --smoke
    python bench/long_context.py --cpu-memory          # the savings at tiny shapes on CPU (no GPU needed)

``--cpu-memory`` trains llama-deep (8 blocks) for 2 steps of 2 x 1,024 tokens in this process, once per setting,
in a fresh process per setting, and reports what autograd kept on the device and in host memory at its peak
(meshtron's own measurement) and how far the process's peak resident memory rose above what it held before
training (model, optimizer state and the step's peaks). On CPU the host is the device, so offloading cannot lower
that peak there: its saving is what leaves the device, measured as kept bytes.
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

SAVINGS = ["--train.activation_checkpointing=full", "--train.activation_offload=true", "--train.mlp_tiles=8"]
YARN = '--model.rope_scaling={"rope_type": "yarn", "factor": %d, "original_max_position_embeddings": 8192}'


def target_settings(name: str, seq_len: int) -> list[str]:
    """The ``meshtron train`` settings of one target at ``seq_len`` tokens."""
    factor = max(1, -(-seq_len // 8192))
    if name == "llama8b-lora":
        return ["--model.preset=llama-8b", "--model.dtype=bfloat16", YARN % factor, "--lora.rank=16", "--lora.alpha=32",
                *SAVINGS]  # fmt: skip
    if name == "llama8b-full":
        return ["--model.preset=llama-8b", YARN % factor, "--fsdp.cpu_offload=true", *SAVINGS]
    if name == "llama1b-full":
        return ["--model.preset=llama-1b", YARN % factor, *SAVINGS]
    if name == "smoke":
        return ["--model.preset=llama-deep", "--model.max_position_embeddings=65536", *SAVINGS]
    raise SystemExit(f"unknown target {name}")


def run_target(name: str, seq_len: int, steps: int, out: Path, timeout: float, extra: list[str]) -> dict:
    """Train ``steps`` steps of one sequence of ``seq_len`` tokens; the figures from its output and metrics."""
    run_dir = out / f"{name}-{seq_len}"
    command = [
        sys.executable, "-m", "meshtron", "train", *target_settings(name, seq_len), f"--data.seq_len={seq_len}",
        "--train.global_batch_size=1", f"--train.steps={steps}", "--checkpoint.interval=0", "--run.progress=false",
        "--schedule.warmup_steps=1", f"--run.output_dir={run_dir}", *extra,
    ]  # fmt: skip
    started = time.time()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, text = 124, (err.stdout or b"").decode() + (err.stderr or b"").decode()
    figures: dict = {"target": name, "seq_len": seq_len, "exit": code, "seconds": round(time.time() - started, 1)}
    kept = re.search(r"autograd kept ([\d.]+) GB of activations for backward at its peak on rank \d+"
                     r"(?: and ([\d.]+) GB in host memory)?", text)  # fmt: skip
    if kept:
        figures["kept_gb"], figures["host_gb"] = float(kept[1]), float(kept[2] or 0)
    peak = re.search(r"peak memory ([\d.]+) GiB measured, ([\d.]+) planned", text)
    if peak:
        figures["peak_gib"], figures["planned_peak_gib"] = float(peak[1]), float(peak[2])
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        speeds = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row][1:]  # the first step warms up
        if speeds:
            figures["tokens_per_s"] = round(sum(speeds) / len(speeds), 1)
    if code != 0:
        figures["tail"] = text[-1500:]
    return figures


CPU_MEMORY_SETTINGS = {
    "plain": [],
    "tiles 8": ["train.mlp_tiles=8"],
    "offload": ["train.activation_offload=true"],
    "checkpointing": ["train.activation_checkpointing=full"],
    "checkpointing + tiles 8": ["train.activation_checkpointing=full", "train.mlp_tiles=8"],
    "checkpointing + offload": ["train.activation_checkpointing=full", "train.activation_offload=true"],
}


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_memory_one(name: str, out: Path) -> dict:
    """Train llama-deep with one of CPU_MEMORY_SETTINGS in this (fresh) process; its figures."""
    import resource

    import torch

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    base = ["model.preset=llama-deep", "data.seq_len=1024", "data.max_documents=200", "data.mask_documents=false",
            "train.steps=2", "train.global_batch_size=2", "run.progress=false", "checkpoint.interval=0"]  # fmt: skip
    settings = [*base, *CPU_MEMORY_SETTINGS[name], f"run.output_dir={out / name.replace(' ', '_')}"]
    cfg = load_config(None, settings, env={})
    before = resident_bytes()
    result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "setting": name,
        "losses": [round(x, 6) for x in result.losses],
        "kept_bytes": result.activation_bytes,
        "host_bytes": result.offloaded_bytes,
        "peak_rss_growth_bytes": peak - before,
    }


def cpu_memory(out: Path) -> None:
    """One JSON line per setting, each trained in a fresh process (its peak resident memory is its own)."""
    for name in CPU_MEMORY_SETTINGS:
        command = [sys.executable, __file__, "--cpu-memory-one", name, "--out", str(out)]
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if lines else json.dumps({"setting": name, "exit": proc.returncode}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=["llama8b-lora", "llama1b-full", "llama8b-full"])
    parser.add_argument("--lora-len", type=int, nargs="+", default=[438272])
    parser.add_argument("--full-len", type=int, nargs="+", default=[131072])
    parser.add_argument("--small-len", type=int, nargs="+", default=[1048576])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--smoke", action="store_true", help="a tiny stand-in on CPU (llama-deep, 4096 tokens)")
    parser.add_argument("--cpu-memory", action="store_true", help="the memory each saving saves, on CPU")
    parser.add_argument("--cpu-memory-one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="where the runs go (default: a temporary folder)")
    args, extra = parser.parse_known_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="meshtron-long-context-"))
    if args.cpu_memory_one:
        print(json.dumps(cpu_memory_one(args.cpu_memory_one, out)), flush=True)
        return
    if args.cpu_memory:
        cpu_memory(out)
        return
    lengths = {"llama8b-lora": args.lora_len, "llama8b-full": args.full_len, "llama1b-full": args.small_len}
    plan = [("smoke", 4096)] if args.smoke else [(t, n) for t in args.targets for n in lengths[t]]
    if args.smoke:
        extra += ["--run.device=cpu", "--precision.mixed_precision=none", "--data.mask_documents=false"]
    for name, seq_len in plan:
        print(json.dumps(run_target(name, seq_len, args.steps, out, args.timeout, extra)), flush=True)


if __name__ == "__main__":
    main()
