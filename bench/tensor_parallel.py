"""Tensor parallelism on CPU: step time, communication volume and state memory per tp degree.

Each tp degree is its own ``torchrun`` launch of pure tensor parallelism (world size = tp,
``parallel.dp_shard=1``, gloo, ``OMP_NUM_THREADS=1`` per rank); tp=1 also goes through torchrun so the
code path is the same. Per degree it reports:

* step time: median seconds per optimizer step, leaving out the first ``--warmup`` steps;
* communication: every collective seen by a ``TorchDispatchMode`` on every rank (DTensor's functional
  collectives and direct ``c10d`` ops), attributed to optimizer steps by a global optimizer-step hook.
  Collectives before the first optimizer step (set-up, and step 1's own) fall in step 1; only the steps
  after ``--warmup`` are averaged. Bytes per rank are ring estimates for group size n: all-reduce
  2(n-1)/n*S, all-gather (n-1)/n*S_out, reduce-scatter and all-to-all (n-1)/n*S_in, broadcast S;
* state memory: parameter + gradient + optimizer bytes per rank after the first step (max over ranks).

Step time is taken in the same run, with the mode installed; its overhead was within run-to-run noise
(about 10-15% on a shared 2-core VM); ``--no-comm-count`` times without it. Each rank has one thread,
so tp=N uses N cores: on a 2-core machine tp=4 runs 4 processes on 2 cores (oversubscribed, pessimistic).
Example:

    python bench/tensor_parallel.py                                  # llama-mini, tp 1 2 4, seq 256
    python bench/tensor_parallel.py --tp 1 2 --no-sequence-parallel --out /tmp/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from launch import launch_workers  # bench/launch.py (this script's folder is on sys.path)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

SKIPPED_OPS = {"wait_tensor", "_wrap_tensor_autograd"}  # not collectives
INPUT_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors")
KINDS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
}


def collective_kind(name: str) -> str:
    """all_reduce / all_gather / reduce_scatter / all_to_all / broadcast / other, from an op's name."""
    plain = name.replace("_", "")
    return next((kind for prefix, kind in KINDS.items() if plain.startswith(prefix)), "other")


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def ring_bytes(kind: str, input_bytes: int, n: int) -> tuple[int, float]:
    """(the op's tensor size S as in the module docstring, estimated bytes one rank sends)."""
    size = input_bytes * n if kind == "all_gather" else input_bytes
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": float(n > 1),
    }.get(kind, 0.0)
    return size, factor * size


class CollectiveCounter(TorchDispatchMode):
    """Counts collectives per optimizer step: {step: {op name: [count, S bytes, ring bytes sent]}}."""

    def __init__(self):
        super().__init__()
        self.step = 0
        self.counts: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
        self.group_sizes: dict[str, set[int]] = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar first, so its collectives come back through here
        kwargs = kwargs or {}
        if func.namespace in ("_c10d_functional", "c10d") and func._opname not in SKIPPED_OPS:
            self.record(func, args, kwargs)
        return func(*args, **kwargs)

    def record(self, func, args, kwargs) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        bound = {arg.name: value for arg, value in zip(func._schema.arguments, args)} | kwargs
        if "group_name" in bound:
            n = _resolve_process_group(bound["group_name"]).size()
        elif "process_group" in bound:
            group = bound["process_group"]  # a TorchScript-boxed ProcessGroup inside the dispatcher
            n = (dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group).size()
        else:
            n = 1
        if "group_size" in bound and bound["group_size"] != n:
            raise RuntimeError(f"{func}: group_size argument {bound['group_size']} != process group size {n}")
        name = f"{func.namespace}.{func._opname}"
        self.group_sizes[name].add(n)
        input_bytes = next((tensor_bytes(bound[key]) for key in INPUT_ARGS if key in bound), 0)
        size, sent = ring_bytes(collective_kind(func._opname), input_bytes, n)
        entry = self.counts[self.step][name]
        entry[:] = entry[0] + 1, entry[1] + size, entry[2] + sent

    def on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.step += 1

    def summary(self, first: int, last: int) -> dict:
        """Per-step averages over optimizer steps [first, last), by op name."""
        steps = last - first
        ops: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])
        for step in range(first, last):
            for name, values in self.counts.get(step, {}).items():
                ops[name] = [total + value for total, value in zip(ops[name], values)]
        by_op = {
            name: {
                "kind": collective_kind(name.split(".", 1)[1]),
                "group_sizes": sorted(self.group_sizes[name]),
                "count_per_step": c / steps,
                "tensor_bytes_per_step": s / steps,
                "ring_bytes_sent_per_step": r / steps,
            }
            for name, (c, s, r) in sorted(ops.items())
        }
        return {
            "steps_counted": steps,
            "collectives_by_step": [sum(v[0] for v in self.counts.get(step, {}).values()) for step in range(last)],
            "collectives_per_step": sum(op["count_per_step"] for op in by_op.values()),
            "ring_bytes_sent_per_step": sum(op["ring_bytes_sent_per_step"] for op in by_op.values()),
            "by_op": by_op,
        }


def worker(args) -> None:
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from meshtron.config import load_config
    from meshtron.resilience.process_group import init_runtime, shutdown_runtime
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.trainer import train

    runtime = init_runtime()
    tp = runtime.world_size
    overrides = [
        f"model.preset={args.preset}",
        f"data.seq_len={args.seq_len}",
        f"data.max_documents={args.documents}",
        f"train.steps={args.steps}",
        f"train.global_batch_size={args.batch}",
        "schedule.warmup_steps=1",
        f"parallel.tp={tp}",
        "parallel.dp_shard=1",
        f"parallel.sequence_parallel={str(args.sequence_parallel).lower()}",
        f"parallel.loss_parallel={str(args.loss_parallel).lower()}",
        "run.progress=false",
        f"run.output_dir={args.run_dir / 'run'}",
    ] + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
    cfg = load_config(None, overrides, env={})
    setup = preflight(cfg, runtime.world_size, runtime.device.type)
    counter = CollectiveCounter()
    if args.comm_count:
        hook = register_optimizer_step_post_hook(counter.on_optimizer_step)
        try:
            with counter:
                result = train(cfg, runtime, setup)
        finally:
            hook.remove()
    else:
        result = train(cfg, runtime, setup)
    seconds = [args.batch * args.seq_len / rate for rate in result.tokens_per_s]
    mine = {
        "rank": runtime.rank,
        "state_bytes": result.state_bytes,
        "comm": counter.summary(args.warmup, args.steps) if args.comm_count else None,
        "steps_seen_by_hook": counter.step,
    }
    ranks = [None] * runtime.world_size
    dist.all_gather_object(ranks, mine)
    if runtime.is_main:
        state_max = max(sum(r["state_bytes"].values()) for r in ranks)
        comm = ranks[0]["comm"]  # by-op breakdown of rank 0; totals are the max over ranks
        if comm is not None:
            for key in ("collectives_per_step", "ring_bytes_sent_per_step"):
                comm[key] = max(r["comm"][key] for r in ranks)
        out = {
            "tp": tp,
            "step_seconds": seconds,
            "median_step_s": statistics.median(seconds[args.warmup :]),
            "losses": result.losses,
            "state_bytes_max": state_max,
            "comm": comm,
            "ranks": ranks,
        }
        (args.run_dir / "result.json").write_text(json.dumps(out, indent=2))
    shutdown_runtime()
    # Rarely (about 1 launch in 15 with the counting mode) a rank aborted during interpreter teardown with
    # "terminate called without an active exception", after all results were written; skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def markdown_table(results: list[dict]) -> str:
    base = next((r["state_bytes_max"] for r in results if r["tp"] == 1), None)
    lines = [
        "| tp | step time s | comm MB/step/rank (ring estimate) | collectives/step | state MB/rank | state vs tp1 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        comm = r["comm"]
        mb = f"{comm['ring_bytes_sent_per_step'] / 1e6:.2f}" if comm else "-"
        calls = f"{comm['collectives_per_step']:g}" if comm else "-"
        ratio = f"{r['state_bytes_max'] / base:.3f}" if base else "-"
        lines.append(
            f"| {r['tp']} | {r['median_step_s']:.3f} | {mb} | {calls} | {r['state_bytes_max'] / 1e6:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-mini")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    parser.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false")
    parser.add_argument(
        "--no-comm-count", dest="comm_count", action="store_false", help="time without the counting mode"
    )
    parser.add_argument("--cache-dir", help="tokenized-data cache (default ~/.cache/meshtron)")
    parser.add_argument("--out", type=Path, help="write the JSON results here (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")
    if args.worker:
        return worker(args)
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-tp-bench-"))
    results = []
    for tp in args.tp:
        print(f"tp={tp}: launching {tp} process(es)", flush=True)
        results.append(launch_workers(__file__, tp, workdir / f"tp{tp}"))
        comm = results[-1]["comm"] or {"by_op": {}}
        print(f"tp={tp}: median step {results[-1]['median_step_s']:.3f}s, ops {sorted(comm['by_op'])}", flush=True)
    summary = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "sequence_parallel": args.sequence_parallel,
        "loss_parallel": args.loss_parallel,
        "cpu_cores": os.cpu_count(),
        "comm_method": "TorchDispatchMode on every rank; collectives attributed to optimizer steps by a global "
        "optimizer-step post-hook; averaged over steps after warmup; bytes are ring estimates sent per rank",
        "results": results,
    }
    print(markdown_table(results))
    out = args.out or workdir / "tensor_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
