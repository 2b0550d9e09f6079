"""Pipeline bubble: measured idle fraction per schedule against theory, on CPU.

Each pipeline rank runs meshtron's schedule construction (``pipeline_schedule``, torch's schedules)
over synthetic stages whose compute is a timed wait: forward takes ``t`` and backward ``2t`` per
stage-rank (split over the stages a rank holds), so the measurement is about the schedule, not
about CPU contention between processes sharing a core. Per optimizer step and rank:

    idle fraction = 1 - (time inside stage forward/backward) / (step wall time)

where the step runs from a barrier before it to a barrier after it (the optimizer step has to wait
for the slowest rank), averaged over ranks and over the steps after the first. Theory for GPipe and 1F1B is
(p-1)/(m+p-1); for interleaved schedules with v stages per rank it is (p-1)/(v*m+p-1). The
difference is schedule overhead: point-to-point transfers, Python bookkeeping, and (zero-bubble
schedules) the split of backward into input and weight parts.

Example:

    python bench/pipeline_bubble.py                        # p 2 and 4, m 4 and 8, GPipe / 1F1B / Interleaved1F1B
    python bench/pipeline_bubble.py --pp 2 --microbatches 8 --schedules 1F1B --forward-ms 50
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from launch import launch_workers  # bench/launch.py (this script's folder is on sys.path)
from torch import nn


class TimedWork(torch.autograd.Function):
    """Waits ``seconds`` in forward and twice that in backward, recording the time spent."""

    @staticmethod
    def forward(ctx, x, weight, seconds, busy):
        started = time.perf_counter()
        time.sleep(seconds)
        ctx.seconds, ctx.busy = seconds, busy
        ctx.save_for_backward(weight)
        out = x * weight
        busy.append(time.perf_counter() - started)
        return out

    @staticmethod
    def backward(ctx, grad):
        started = time.perf_counter()
        time.sleep(2 * ctx.seconds)
        (weight,) = ctx.saved_tensors
        ctx.busy.append(time.perf_counter() - started)
        return grad * weight, grad.sum(0), None, None


class TimedStage(nn.Module):
    def __init__(self, width: int, seconds: float, busy: list):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.seconds, self.busy = seconds, busy

    def forward(self, x):
        return TimedWork.apply(x, self.weight, self.seconds, self.busy)


def theory(p: int, m: int, stages_per_rank: int) -> float:
    """Idle fraction of an ideal schedule: (p-1)/(m+p-1), with v stages per rank (p-1)/(v*m+p-1)."""
    return (p - 1) / (stages_per_rank * m + p - 1)


def worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from meshtron.config import ParallelConfig
    from meshtron.distributed.pipeline_parallel import local_stage_ids, pipeline_schedule, stages_per_rank

    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = []
    for schedule_name in args.schedules:
        for m in args.microbatches:
            cfg = ParallelConfig(pp=p, pp_schedule=schedule_name, pp_microbatches=m)
            v = stages_per_rank(cfg)
            busy: list[float] = []
            ids = local_stage_ids(rank, cfg)
            stages = [
                PipelineStage(TimedStage(args.width, args.forward_ms / 1000 / v, busy), i, p * v, torch.device("cpu"))
                for i in ids
            ]
            schedule = pipeline_schedule(stages, cfg, m, lambda out, target: (out * target).sum())
            batch = torch.ones(m * 2, args.width)
            fractions = []
            for step in range(args.steps):
                busy.clear()
                dist.barrier()
                started = time.perf_counter()
                kwargs = {"target": batch, "losses": []} if (p * v - 1) in ids else {}
                schedule.step(*((batch,) if 0 in ids else ()), **kwargs)
                dist.barrier()  # the step ends when the last rank is done (the optimizer step waits for it)
                wall = time.perf_counter() - started
                if step > 0:  # the first step also infers stage shapes
                    fractions.append(1 - sum(busy) / wall)
            mine = torch.tensor([sum(fractions) / len(fractions)], dtype=torch.float64)
            dist.all_reduce(mine)
            rows.append(
                {
                    "schedule": schedule_name,
                    "p": p,
                    "m": m,
                    "stages_per_rank": v,
                    "idle_measured": float(mine) / p,
                    "idle_theory": theory(p, m, v),
                }
            )
    if rank == 0:
        (args.run_dir / "result.json").write_text(json.dumps({"rows": rows}, indent=2))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B", "Interleaved1F1B"])
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward time per rank and microbatch")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-pp-bench-"))
    rows = []
    for p in args.pp:
        print(f"pp={p}: launching {p} processes", flush=True)
        rows += launch_workers(__file__, p, workdir / f"pp{p}")["rows"]
    lines = [
        "| schedule | p | m | stages/rank | idle measured | theory | difference |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['stages_per_rank']} | {r['idle_measured']:.3f} | "
            f"{r['idle_theory']:.3f} | {r['idle_measured'] - r['idle_theory']:+.3f} |"
        )
    print("\n".join(lines))
    out = args.out or workdir / "pipeline_bubble.json"
    out.write_text(json.dumps({"forward_ms": args.forward_ms, "cpu_cores": os.cpu_count(), "rows": rows}, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
