"""Context parallelism on CPU: activation memory per rank and step time per cp degree and sequence length.

Each cp degree is one ``torchrun`` launch (world size = cp, gloo, one thread per rank) that trains one
optimizer step of batch 1 at each requested sequence length. Per rank it measures:

* activation memory: the peak bytes of the tensors autograd saves for backward during the step (each storage
  counted once, parameters left out), as the trainer measures them (meshtron.distributed.activation_memory.measure, its
  ``saved_tensors_hooks``). With one micro-batch they are all alive at the end of forward, so this is the
  activation peak that context parallelism is meant to cut (temporaries of a single op come on top);
* peak RSS of the process (``ru_maxrss``), for reference: it includes the interpreter, torch,
  transformers and the model state;
* step time (seconds for the one step).

``--budget-mb`` turns the measurements into "the longest sequence that fits": the largest measured
length whose activation memory per rank stays within the budget, per cp degree.

On CUDA (or with ``--tiles``) it measures one context-parallel tile instead: forward + backward
time (median, CUDA events) and peak memory above the inputs of meshtron's tile kernels
(``tile_forward`` + ``tile_backward``), of the plain fp32 kernel they replace (``math``) and of SDPA
flash, for a causal (diagonal), a full (off-diagonal) and a document-masked diagonal tile (default:
4096 x 4096, 32 query / 8 key-value heads, head dim 128, bf16), with each kernel's relative error
against the fp32 plain kernel (exit status 1 above the tolerance). ``--train`` runs the training
launches after them (on a GPU machine each launch needs ``cp`` GPUs).

Example:

    python bench/context_parallel.py                                   # cp 1 2 4 at 4096 tokens
    python bench/context_parallel.py --cp 1 4 --seq-len 2048 4096 8192 16384 --budget-mb 64
    python bench/context_parallel.py --tiles                           # tile kernels (default on CUDA)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from attention_kernels import packed_document_ids, relative_error, time_ms  # bench/attention_kernels.py
from launch import launch_workers  # bench/launch.py (this script's folder is on sys.path)

TILE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""Largest relative error of meshtron's tile kernels against the fp32 plain kernel that passes."""


def worker(args) -> None:
    import torch.distributed as dist

    from meshtron.config import load_config
    from meshtron.resilience.process_group import init_runtime, shutdown_runtime
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.trainer import train

    runtime = init_runtime()
    cp = runtime.world_size
    rows = []
    for seq_len in args.seq_len:
        overrides = [
            f"model.preset={args.preset}",
            f"data.seq_len={seq_len}",
            f"data.max_documents={args.documents}",
            "train.steps=1",
            "train.global_batch_size=1",
            "schedule.warmup_steps=0",
            f"parallel.cp={cp}",
            "parallel.dp_shard=1",
            f"parallel.cp_method={args.method}",
            f"data.mask_documents={str(args.mask_documents).lower()}",
            "run.progress=false",
            f"run.output_dir={args.run_dir / f'run{seq_len}'}",
        ] + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
        cfg = load_config(None, overrides, env={})
        setup = preflight(cfg, runtime.world_size, runtime.device.type)
        # its one step measures the activations (meshtron.distributed.activation_memory.measure)
        result = train(cfg, runtime, setup)
        mine = torch.tensor(
            [
                result.activation_bytes,
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                seq_len / result.tokens_per_s[0],
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "seq_len": seq_len,
                "activation_bytes": int(mine[0]),
                "peak_rss_bytes": int(mine[1]),
                "step_s": float(mine[2]),
                "loss": result.losses[0],
            }
        )
        del result
    if runtime.is_main:
        (args.run_dir / "result.json").write_text(json.dumps({"cp": cp, "rows": rows}, indent=2))
    shutdown_runtime()


def markdown_table(results: list[dict]) -> str:
    base = {row["seq_len"]: row["activation_bytes"] for r in results if r["cp"] == 1 for row in r["rows"]}
    lines = [
        "| cp | seq_len | activation MB/rank | vs cp=1 | peak RSS MB/rank | step s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for row in r["rows"]:
            ratio = f"{row['activation_bytes'] / base[row['seq_len']]:.3f}" if row["seq_len"] in base else "-"
            lines.append(
                f"| {r['cp']} | {row['seq_len']} | {row['activation_bytes'] / 2**20:.1f} | {ratio} | "
                f"{row['peak_rss_bytes'] / 2**20:.0f} | {row['step_s']:.2f} |"
            )
    return "\n".join(lines)


def longest_within(results: list[dict], budget_mb: float) -> dict[int, int | None]:
    """Per cp degree, the longest measured sequence whose activation memory per rank fits the budget."""
    fits = {}
    for r in results:
        ok = [row["seq_len"] for row in r["rows"] if row["activation_bytes"] <= budget_mb * 2**20]
        fits[r["cp"]] = max(ok) if ok else None
    return fits


def tile_cases(args, device: torch.device):
    """(name, meshtron's mask, the plain kernel's mask, SDPA's is_causal) of each tile measured."""
    from meshtron.distributed.context_parallel import tiles

    docs = packed_document_ids(args.tile_batch, args.tile_len, args.tile_documents, torch.Generator().manual_seed(0))
    docs = docs.to(device)
    dense = tiles.dense_chunk_mask(docs, docs, True)
    fused = tiles.chunk_block_mask(docs, docs, True) if tiles.mask_kind(device, "auto") == "flex" else dense
    return [
        ("causal (diagonal)", "causal", "causal", True),
        ("full (off-diagonal)", None, None, False),
        (f"{args.tile_documents} documents (diagonal)", fused, dense, True),
    ]


def tile_figures(args, device: torch.device) -> tuple[list[dict], bool]:
    """Forward + backward of one tile by each kernel: time, peak memory, error vs the fp32 plain kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from meshtron.distributed.context_parallel.tile_kernels import tile_backward, tile_forward

    dtype = getattr(torch, args.tile_dtype)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(args.tile_batch, heads, args.tile_len, args.head_dim, device=device, generator=gen).to(dtype)
        for heads in (args.heads, args.kv_heads, args.kv_heads)
    )
    grad_out = torch.randn(q.shape, device=device, generator=gen).to(dtype)
    scale = args.head_dim**-0.5
    flash = device.type == "cuda" and dtype != torch.float32

    def meshtron(mask, kernel):
        def run():
            out, lse = tile_forward(q, k, v, mask, scale, kernel)
            return (out, *tile_backward(q, k, v, mask, scale, out, lse, grad_out, kernel))

        return run

    def sdpa(causal):
        def run():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=True)
            out.backward(grad_out)
            return (out, *(t.grad for t in leaves))

        return run

    rows, ok = [], True
    for case, fused_mask, plain_mask, causal in tile_cases(args, device):
        reference = [t.float() for t in meshtron(plain_mask, "math")()]  # the fp32 plain kernel (inputs as given)
        documents = "documents" in case
        sdpa_name = f"SDPA {'flash' if flash else 'default'}" + (" (causal, no documents)" if documents else "")
        kernels = [
            ("meshtron (auto)", meshtron(fused_mask, "auto"), True),
            ("meshtron math (fp32, the reference)", meshtron(plain_mask, "math"), False),
            (sdpa_name, sdpa(causal), not documents),
        ]
        for name, run, comparable in kernels:
            error = max(relative_error(got, want) for got, want in zip(run(), reference)) if comparable else None
            if name == "meshtron (auto)":
                ok &= error <= TILE_TOLERANCE[dtype]
            seconds = time_ms(run, args.iters, args.warmup, device)
            rows.append(
                {
                    "tile": case,
                    "kernel": name,
                    "fwd_bwd_ms": seconds,
                    "peak_bytes": _peak_bytes(run, device),
                    "rel_error": error,
                }
            )
    return rows, ok


def _peak_bytes(run, device: torch.device) -> int | None:
    """Peak CUDA memory of ``run()`` above what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def tiles_table(rows: list[dict]) -> str:
    lines = ["| tile | kernel | fwd+bwd ms | peak MiB | rel. error vs fp32 |", "|---|---|---:|---:|---:|"]
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        error = "-" if r["rel_error"] is None else f"{r['rel_error']:.1e}"
        lines.append(f"| {r['tile']} | {r['kernel']} | {r['fwd_bwd_ms']:.2f} | {peak} | {error} |")
    return "\n".join(lines)


def run_tiles(args) -> tuple[dict, bool]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (timings say nothing about a GPU)"
    print(
        f"tile {args.tile_len} x {args.tile_len}, batch {args.tile_batch}, heads {args.heads}/{args.kv_heads}, "
        f"head dim {args.head_dim}, {args.tile_dtype}, on {name}, torch {torch.__version__}",
        flush=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        rows, ok = tile_figures(args, device)
    print(tiles_table(rows))
    print("check:", "PASS" if ok else "FAIL")
    return {"device": name, "dtype": args.tile_dtype, "length": args.tile_len, "rows": rows}, ok


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--method", default="ring", choices=["ring", "allgather", "ulysses"])
    parser.add_argument("--mask-documents", action="store_true", help="document masks on (default: causal only)")
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--budget-mb", type=float, help="report the longest sequence whose activations fit this")
    parser.add_argument("--cache-dir", help="tokenized-data cache (default ~/.cache/meshtron)")
    parser.add_argument("--out", type=Path, help="write the JSON results here (default: a temp dir)")
    cuda = torch.cuda.is_available()
    tiles = parser.add_argument_group("tile kernels (default on CUDA)")
    tiles.add_argument("--tiles", action="store_true", help="measure the tile kernels (also off CUDA)")
    tiles.add_argument("--train", action="store_true", help="run the training launches after the tiles too")
    tiles.add_argument("--tile-len", type=int, default=4096 if cuda else 256)
    tiles.add_argument("--tile-batch", type=int, default=1)
    tiles.add_argument("--heads", type=int, default=32 if cuda else 4)
    tiles.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    tiles.add_argument("--head-dim", type=int, default=128 if cuda else 16)
    tiles.add_argument("--tile-documents", type=int, default=8, help="documents per row of the masked tile")
    tiles.add_argument(
        "--tile-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16" if cuda else "float32"
    )
    tiles.add_argument("--iters", type=int, default=20 if cuda else 3)
    tiles.add_argument("--warmup", type=int, default=5 if cuda else 1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if args.worker:
        return worker(args)
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-cp-bench-"))
    ok, tile_summary = True, None
    if args.tiles or cuda:
        tile_summary, ok = run_tiles(args)
        if not args.train:
            out = args.out or workdir / "context_parallel_tiles.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"tiles": tile_summary}, indent=2))
            print(f"results: {out}")
            return 0 if ok else 1
    results = []
    for cp in args.cp:
        print(f"cp={cp}: launching {cp} process(es) for seq_len {args.seq_len}", flush=True)
        results.append(launch_workers(__file__, cp, workdir / f"cp{cp}"))
    print(markdown_table(results))
    summary = {
        "preset": args.preset,
        "method": args.method,
        "mask_documents": args.mask_documents,
        "cpu_cores": os.cpu_count(),
        "results": results,
    }
    if tile_summary is not None:
        summary["tiles"] = tile_summary
    if args.budget_mb:
        summary["longest_within_budget"] = longest_within(results, args.budget_mb)
        for cp, length in summary["longest_within_budget"].items():
            print(f"cp={cp}: longest measured sequence within {args.budget_mb:g} MB of activations per rank: {length}")
    out = args.out or workdir / "context_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
