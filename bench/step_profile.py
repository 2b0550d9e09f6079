"""Where a training step's time goes: meshtron's own training loop under torch.profiler, kernels grouped by kind.

One process, meshtron's defaults for the bench (fp32 master weights, bf16 compute, compile on CUDA). The first
``--warmup`` optimizer steps run unprofiled (compilation, allocator warm-up); the next ``--steps`` are recorded,
cut at optimizer steps by an optimizer post-step hook. On CUDA the table sums device (kernel) time; on CPU the
operators' own CPU time. Kinds, by kernel name: matmul, attention (FlexAttention / SDPA), softmax + cross-entropy,
copies and casts, optimizer, communication, other. Examples:

    python bench/step_profile.py                                   # CUDA: llama-1b, seq 2048, batch 8
    python bench/step_profile.py --set train.loss_chunk_size=0     # the unchunked loss, for comparison
    python bench/step_profile.py --preset llama-tiny --seq-len 128 --batch 2 --steps 2 --warmup 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

KINDS = [  # first match wins; patterns are matched against lower-cased kernel / operator names
    ("communication", r"nccl|all_reduce|allreduce|all_gather|reduce_scatter|all_to_all|c10d"),
    ("optimizer", r"adam|foreach|multi_tensor_apply|_fused_"),
    ("softmax + cross-entropy", r"softmax|log_softmax|nll_loss|cross_entropy|logsumexp"),
    ("attention", r"flex_attention|flash|fmha|attention|sdpa|triton_tem_fused"),
    (
        "matmul",
        r"gemm|cutlass|sm90_xmma|sm80_xmma|ampere|hopper|\bmm\b|aten::mm|aten::addmm|aten::bmm|matmul|_scaled_mm|wgmma",
    ),
    ("copies and casts", r"copy|to_copy|direct_copy|convert|cast|_to_bf16|bfloat16|elementwise_kernel_with_index"),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def breakdown(events, device_type: str, steps: int) -> dict[str, float]:
    """Milliseconds per step of each kind: device time of CUDA kernels, or self CPU time of operators."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if device_type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            micros = event.self_device_time_total
        else:
            if event.device_type != torch.autograd.DeviceType.CPU or not event.key.startswith("aten::"):
                continue
            micros = event.self_cpu_time_total
        totals[kind_of(event.key)] += micros / 1000 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def run(args) -> dict:
    from peers import data_overrides
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from meshtron.config import load_config
    from meshtron.train.runtime import init_runtime, shutdown_runtime
    from meshtron.train.trainer import train

    output_dir = Path(tempfile.mkdtemp(prefix="meshtron-profile-"))
    cfg = load_config(
        None,
        data_overrides(args.preset, args.seq_len, args.documents)
        + [
            f"train.steps={args.warmup + args.steps}",
            f"train.global_batch_size={args.batch}",
            "model.dtype=float32",
            "train.mixed_precision=bf16",
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
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=args.warmup, warmup=0, active=args.steps),
    )
    handle = register_optimizer_step_post_hook(lambda *_: profiler.step())
    runtime = init_runtime(device=args.device)
    try:
        with profiler:
            result = train(cfg, runtime)
    finally:
        handle.remove()
        shutdown_runtime()
    kinds = breakdown(profiler.key_averages(), args.device, args.steps)
    measured = result.tokens_per_s[args.warmup :]
    step_ms = 1000 * args.batch * args.seq_len / (sum(measured) / len(measured)) if measured else None
    return {
        "device": args.device,
        "preset": args.preset,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "overrides": args.set,
        "step_ms": step_ms,
        "kinds_ms_per_step": kinds,
    }


def table(report: dict) -> str:
    total = sum(report["kinds_ms_per_step"].values())
    step = report["step_ms"]
    basis = "device" if report["device"] == "cuda" else "CPU operator"
    rows = [
        f"step: {step:.1f} ms (wall, profiled steps, profiler on); {basis} time per step: {total:.1f} ms",
        "| kind | ms per step | share of the step |",
        "| --- | ---: | ---: |",
    ]
    for kind, ms in report["kinds_ms_per_step"].items():
        rows.append(f"| {kind} | {ms:.1f} | {ms / step:.1%} |")
    return "\n".join(rows)


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
