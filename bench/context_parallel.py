"""Context parallelism on CPU: activation memory per rank and step time per cp degree and sequence length.

Each cp degree is one ``torchrun`` launch (world size = cp, gloo, one thread per rank) that trains one
optimizer step of batch 1 at each requested sequence length. Per rank it measures:

* activation memory: bytes of the tensors autograd saves for backward during the step (each storage
  counted once, parameters left out), taken with ``torch.autograd.graph.saved_tensors_hooks``. With
  one micro-batch they are all alive at the end of forward, so this is the activation peak that
  context parallelism is meant to cut (temporaries of a single op come on top);
* peak RSS of the process (``ru_maxrss``), for reference: it includes the interpreter, torch,
  transformers and the model state;
* step time (seconds for the one step).

``--budget-mb`` turns the measurements into "the longest sequence that fits": the largest measured
length whose activation memory per rank stays within the budget, per cp degree.

Example:

    python bench/context_parallel.py                                   # cp 1 2 4 at 4096 tokens
    python bench/context_parallel.py --cp 1 4 --seq-len 2048 4096 8192 16384 --budget-mb 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path

import torch
from torch import nn

from launch import launch_workers  # bench/launch.py (this script's folder is on sys.path)


class SavedActivations:
    """Bytes of the storages autograd saves for backward (parameters excluded), reset per optimizer step."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self.per_step: list[int] = []

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.per_step.append(sum(self.storages.values()))
        self.storages.clear()


def worker(args) -> None:
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from meshtron.config import load_config
    from meshtron.train.runtime import init_runtime, shutdown_runtime
    from meshtron.train.trainer import preflight, train

    runtime = init_runtime()
    cp = runtime.world_size
    rows = []
    for seq_len in args.seq_len:
        overrides = [
            f"model.preset={args.preset}", f"data.seq_len={seq_len}", f"data.max_documents={args.documents}",
            "train.steps=1", "train.global_batch_size=1", "train.warmup_steps=0", f"parallel.cp={cp}",
            "parallel.dp_shard=1", f"parallel.cp_method={args.method}",
            f"data.mask_documents={str(args.mask_documents).lower()}", "run.progress=false",
            f"run.output_dir={args.run_dir / f'run{seq_len}'}",
        ] + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
        cfg = load_config(None, overrides, env={})
        plan = preflight(cfg, runtime.world_size, runtime.device.type)
        saved = SavedActivations()
        hook = register_optimizer_step_post_hook(saved.on_optimizer_step)
        try:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                result = train(cfg, runtime, plan)
        finally:
            hook.remove()
        mine = torch.tensor(
            [saved.per_step[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, seq_len / result.tokens_per_s[0]],
            dtype=torch.float64,
        )
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        rows.append({"seq_len": seq_len, "activation_bytes": int(mine[0]), "peak_rss_bytes": int(mine[1]),
                     "step_s": float(mine[2]), "loss": result.losses[0]})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--method", default="ring", choices=["ring", "allgather"])
    parser.add_argument("--mask-documents", action="store_true", help="document masks on (default: causal only)")
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--budget-mb", type=float, help="report the longest sequence whose activations fit this")
    parser.add_argument("--cache-dir", help="tokenized-data cache (default ~/.cache/meshtron)")
    parser.add_argument("--out", type=Path, help="write the JSON results here (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-cp-bench-"))
    results = []
    for cp in args.cp:
        print(f"cp={cp}: launching {cp} process(es) for seq_len {args.seq_len}", flush=True)
        results.append(launch_workers(__file__, cp, workdir / f"cp{cp}"))
    print(markdown_table(results))
    summary = {"preset": args.preset, "method": args.method, "mask_documents": args.mask_documents,
               "cpu_cores": os.cpu_count(), "results": results}
    if args.budget_mb:
        summary["longest_within_budget"] = longest_within(results, args.budget_mb)
        for cp, length in summary["longest_within_budget"].items():
            print(f"cp={cp}: longest measured sequence within {args.budget_mb:g} MB of activations per rank: {length}")
    out = args.out or workdir / "context_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
