"""Where a training step's time goes: meshtron's own training loop under torch.profiler, kernels grouped by kind.

One process, meshtron's defaults for the bench (fp32 master weights, bf16 compute, compile on CUDA). The first
``--warmup`` optimizer steps run unprofiled (compilation, allocator warm-up); the next ``--steps`` are recorded,
cut at optimizer steps by an optimizer post-step hook, and their Chrome trace is written to the output directory.
The table is ``run.profile_steps``'s summary (meshtron/metrics/profiling.py, docs/profiling.md): on CUDA the GPU
kernel, memcpy and memset time by kernel name, per step and as a share of the kernel time, and the GPU-busy share;
on CPU the operators' own CPU time. Kinds: matmul, attention, communication, optimizer, copies (and casts), other.
Examples:

    python bench/step_profile.py                                   # CUDA: llama-1b, seq 2048, batch 8
    python bench/step_profile.py --set train.loss_chunk_size=0     # the unchunked loss, for comparison
    python bench/step_profile.py --preset llama-tiny --seq-len 128 --batch 2 --steps 2 --warmup 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def run(args) -> dict:
    from peers import data_overrides
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from meshtron.config import load_config
    from meshtron.metrics.profiling import summarize_profile
    from meshtron.resilience.process_group import init_runtime, shutdown_runtime
    from meshtron.train.trainer import train

    output_dir = Path(tempfile.mkdtemp(prefix="meshtron-profile-"))
    cfg = load_config(
        None,
        data_overrides(args.preset, args.seq_len, args.documents)
        + [
            f"train.steps={args.warmup + args.steps}",
            f"train.global_batch_size={args.batch}",
            "model.dtype=float32",
            "precision.mixed_precision=bf16",
            f"run.device={args.device}",
            f"run.output_dir={output_dir}",
            "run.progress=false",
            f"data.mask_documents={str(args.mask_documents).lower()}",
        ]
        + args.set,
        env={},
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace = output_dir / "trace.json"
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=args.warmup, warmup=0, active=args.steps),
        on_trace_ready=lambda done: done.export_chrome_trace(str(trace)),
    )
    handle = register_optimizer_step_post_hook(lambda *_: profiler.step())
    runtime = init_runtime(device=args.device)
    try:
        with profiler:
            result = train(cfg, runtime)
    finally:
        handle.remove()
        shutdown_runtime()
    summary = summarize_profile(profiler, trace, args.device, args.steps)
    measured = result.tokens_per_s[args.warmup :]
    step_ms = 1000 * args.batch * args.seq_len / (sum(measured) / len(measured)) if measured else None
    return {
        "device": args.device,
        "preset": args.preset,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "overrides": args.set,
        "step_ms": step_ms,
        "trace": str(trace),
        "basis": summary.basis,
        "kinds_ms_per_step": {kind: micros / 1e3 / args.steps for kind, micros in summary.times_us.items()},
        "kinds_share": {kind: summary.share(kind) for kind in summary.times_us},
        "busy_share": summary.busy_share,
        "wall_ms": summary.wall_us / 1e3 if summary.wall_us else None,
        "summary": summary.markdown(),
    }


def table(report: dict) -> str:
    total = sum(report["kinds_ms_per_step"].values())
    step = report["step_ms"]
    wall = f"{step:.1f} ms" if step else "not measured"
    head = f"step: {wall} (wall, profiled steps, profiler on); {report['basis']}: {total:.1f} ms per step"
    return f"{head}\n{report['summary']}\ntrace: {report['trace']}"


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b" if cuda else "llama-small")
    parser.add_argument("--seq-len", type=int, default=2048 if cuda else 256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=5 if cuda else 1, help="unprofiled steps first")
    parser.add_argument("--documents", type=int, default=400, help="data.max_documents of the builtin corpus")
    parser.add_argument("--mask-documents", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more meshtron settings")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
