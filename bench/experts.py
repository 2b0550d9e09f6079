"""Expert parallelism (EP) on CPU: tokens/s and measured all-to-all bytes per ep degree.

Each (world size, ep) layout is its own ``torchrun`` launch of ``meshtron train`` (``meshtron.cli.main``, as
a user starts it; gloo, ``OMP_NUM_THREADS=1`` per rank) with ``parallel.dp_shard=N parallel.ep=E`` on a
Qwen3-MoE derived from the ``qwen3moe-tiny`` preset with more and larger experts (default 8 experts, top-2,
hidden 128, expert FFN 256, 4 MoE layers; registered as preset ``qwen3moe-epbench`` inside the worker
processes only). ``ep`` is borrowed from the FSDP ranks (docs/moe.md): the world size, the global batch, the
data each rank reads and the losses are the same for every ep, so **ep=1 is plain FSDP over the same N
processes** (the experts sharded on dim 0 by FSDP and gathered whole on every rank for compute, transformers'
own experts forward) and ep>1 only changes where the experts live and how tokens reach them. Per layout:

* tokens/s: the trainer's own figure (global tokens of the step / the step's wall time on rank 0, read from
  the run's ``metrics.jsonl``), median over the steps after the first ``--warmup``;
* all-to-all bytes, **measured**: inside the worker processes only, ``torch.distributed.all_to_all_single``
  (the per-expert count exchange) and ``torch.distributed._functional_collectives.all_to_all_single_autograd``
  (token dispatch and combine; ``expert_parallel_forward`` imports it at every call) are wrapped. The wrapper
  reads the tensors and split sizes actually passed, and wraps the call's input and output in identity
  autograd functions whose backward sees the gradients the two backward all-to-alls carry. Per rank and
  optimizer step (a global optimizer-step hook attributes calls to steps) it sums the bytes sent to *other*
  ranks (the rows of the splits for other ranks x row bytes) and, for reference, the whole tensors passed
  (the ``rank<r>.json`` files beside the results keep every counted step of every rank);
* predicted bytes: ``all_to_all_traffic`` of meshtron on the routing that really happened (every EP rank's
  ``top_k_index`` of every MoE layer in every counted step, captured by a forward pre-hook on the experts)
  -- ``sent_bytes(rank)`` summed over the layers -- compared with the measured off-rank row bytes of the
  same rank and step;
* the off-rank share: rows a rank dispatches to other ranks / all (token, expert) pairs it routes
  (uniform routing: (ep-1)/ep), and the expert load: the share of its EP group's routed rows that the
  busiest rank's experts compute (balanced: 1/ep), mean over layers and counted steps;
* all-to-all seconds per step: wall time inside the wrapped calls, forward and backward, waits for the
  other ranks of the EP group included (every all-to-all synchronizes them: the combine waits for the rank
  whose experts got the most rows), for the slowest and the fastest rank; split into the count exchange
  (a blocking host sync) and the token all-to-alls;
* the other collectives: ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (what FSDP2
  calls for parameters and gradients on torch 2.13; ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
  on torch 2.11) and ``all_reduce`` (loss, gradient norm), those of them the installed torch has, wrapped and
  converted to ring estimates of the bytes a rank sends (all-gather and reduce-scatter (n-1)/n x the full
  tensor, all-reduce 2(n-1)/n; ``--no-collective-count`` leaves them unwrapped): at ep=1 FSDP gathers every
  expert on every rank, under EP only over the ``efsdp`` ranks holding the same experts.

Every layout runs ``--rounds`` times, the order alternating between rounds; time figures are medians over
rounds (bytes and losses do not change between rounds: same data, seeds and routing). Runs with more
processes than cores are oversubscribed (4 processes on a 2-core machine): their tokens/s
and all-to-all seconds are pessimistic, the bytes are not affected. Example:

    python bench/experts.py                                   # N=2: ep 1 2; N=4: ep 1 2 4; 3 rounds (about 5 min)
    python bench/experts.py --world 4 --ep 1 4 --steps 12 --out /tmp/ep.json
    python bench/experts.py --device cuda --mixed-precision bf16 --world 8 --ep 1 2 4 8 \\
        --experts 64 --top-k 8 --hidden 1024 --moe-intermediate 512 --layers 8 --seq-len 2048 --batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from data_parallel import other_tasks, wait_for_idle  # bench/data_parallel.py
from launch import launch_workers  # bench/launch.py (this script's folder is on sys.path)

PRESET = "qwen3moe-epbench"

OTHER_COLLECTIVES = {
    # name: (its parameter holding the full tensor, the ring share of that tensor's bytes a rank sends, n ranks)
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
}
"""The ``torch.distributed`` collectives besides all-to-all that the worker counts, where torch has them."""


def preset_settings(args) -> dict:
    """``qwen3moe-tiny`` with the benchmark's expert count, top-k and sizes."""
    from meshtron.models.presets import PRESETS

    heads = max(args.hidden // 32, 1)
    return dict(
        PRESETS["qwen3moe-tiny"],
        hidden_size=args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        intermediate_size=2 * args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        head_dim=args.hidden // heads,
        max_position_embeddings=max(2048, args.seq_len),
    )


def overrides(args, nproc: int, ep: int, output_dir: Path) -> list[str]:
    return [
        f"model.preset={PRESET}",
        f"data.seq_len={args.seq_len}",
        f"data.max_documents={args.documents}",
        f"train.steps={args.steps}",
        f"train.global_batch_size={args.batch}",
        "schedule.warmup_steps=2",
        f"precision.mixed_precision={args.mixed_precision}",
        f"train.compile={args.compile}",
        f"parallel.dp_shard={nproc}",
        f"parallel.ep={ep}",
        f"run.device={args.device}",
        "run.progress=false",
        f"run.output_dir={output_dir}",
    ] + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])


# ---------------------------------------------------------------------------------------------- worker


class AllToAllCounter:
    """Wraps the all-to-all calls of meshtron's EP forward in this process and counts what they carry.

    ``steps[step]``: {"calls", "count_bytes" (count exchange, whole tensor), "tensor_bytes" (token all-to-alls,
    whole input tensors, forward and backward), "fwd_off_rank_bytes", "bwd_off_rank_bytes" (rows sent to other
    ranks), "count_seconds", "token_seconds" (wall time in the calls, waits for the other ranks included),
    "other_calls", "other_ring_bytes" (see :meth:`counted_other`)}. ``routing[step]``: this rank's
    ``top_k_index`` per MoE layer call, in call order."""

    def __init__(self, device_type: str):
        self.step = 0
        self.device_type = device_type
        self.steps: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.routing: dict[int, list] = defaultdict(list)
        self.ep_ranks: list[int] | None = None
        self.group_sizes: set[int] = set()
        self.backward_started = 0.0

    def install(self, count_others: bool = True) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.optim.optimizer import register_optimizer_step_post_hook

        counter = self
        plain, autograd = dist.all_to_all_single, funcol.all_to_all_single_autograd

        class Marker(torch.autograd.Function):
            """Identity; its backward records the gradient the backward all-to-all sends (``where="out"``) or
            the time it finished (``where="in"``)."""

            @staticmethod
            def forward(ctx, x, where, splits, me):
                ctx.where, ctx.splits, ctx.me = where, splits, me
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                entry = counter.steps[counter.step]
                if ctx.where == "out":  # backward of the output: this gradient is about to be sent back
                    counter.sync()
                    entry["tensor_bytes"] += grad.numel() * grad.element_size()
                    row = grad[0].numel() * grad.element_size() if grad.ndim == 2 else 0
                    entry["bwd_off_rank_bytes"] += row * sum(n for i, n in enumerate(ctx.splits) if i != ctx.me)
                    entry["calls"] += 1
                    counter.backward_started = time.perf_counter()
                else:
                    counter.sync()
                    entry["token_seconds"] += time.perf_counter() - counter.backward_started
                return grad, None, None, None

        def counted_plain(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            started = time.perf_counter()
            work = plain(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
            entry = counter.steps[counter.step]
            entry["count_seconds"] += time.perf_counter() - started
            entry["calls"] += 1
            entry["count_bytes"] += input.numel() * input.element_size()
            return work

        def counted_autograd(self, output_split_sizes, input_split_sizes, group, tag=""):
            from torch.distributed._functional_collectives import AsyncCollectiveTensor

            me = dist.get_rank(group)
            counter.group_sizes.add(dist.get_world_size(group))
            entry = counter.steps[counter.step]
            row = self[0].numel() * self.element_size() if self.ndim == 2 else 0
            entry["tensor_bytes"] += self.numel() * self.element_size()
            entry["fwd_off_rank_bytes"] += row * sum(n for i, n in enumerate(input_split_sizes) if i != me)
            entry["calls"] += 1
            started = time.perf_counter()
            x = Marker.apply(self, "in", None, me) if self.requires_grad else self
            out = autograd(x, output_split_sizes, input_split_sizes, group, tag)
            if isinstance(out, AsyncCollectiveTensor):
                out = out.trigger_wait()
            counter.sync()
            entry["token_seconds"] += time.perf_counter() - started
            return Marker.apply(out, "out", list(output_split_sizes), me) if out.requires_grad else out

        def capture_routing(module, args):
            if hasattr(module, "gate_up_proj") and hasattr(module, "act_fn") and len(args) == 3:
                counter.routing[counter.step].append(args[1].detach().to("cpu", copy=True))
                mesh = getattr(module, "ep_mesh", None)
                if mesh is not None and counter.ep_ranks is None:
                    counter.ep_ranks = dist.get_process_group_ranks(mesh.get_group())

        dist.all_to_all_single = counted_plain
        funcol.all_to_all_single_autograd = counted_autograd
        if count_others:
            # Only the names this torch has are wrapped: FSDP2 calls all_gather_single / reduce_scatter_single on
            # torch 2.13, all_gather_into_tensor / reduce_scatter_tensor on torch 2.11 (which has no *_single).
            # On 2.13 the old names call the new ones inside distributed_c10d, past these wrappers: no call counts
            # twice. Collectives of torch.ops._c10d_functional (DTensor redistribution, compiled graphs) are not
            # counted.
            for name in OTHER_COLLECTIVES:
                if hasattr(dist, name):
                    setattr(dist, name, self.counted_other(getattr(dist, name), name))
        torch.nn.modules.module.register_module_forward_pre_hook(capture_routing)
        register_optimizer_step_post_hook(lambda *_: setattr(counter, "step", counter.step + 1))

    def counted_other(self, function, name: str):
        """``function`` (the ``torch.distributed`` collective ``name``), counting the ring estimate of the bytes
        this rank sends in ``steps[step]["other_ring_bytes"]``: ``factor(n) x S``, S the full (gathered, or to be
        scattered, or reduced) tensor's bytes, n the group size (``OTHER_COLLECTIVES``)."""
        import inspect

        import torch.distributed as dist

        counter = self
        full_tensor, factor = OTHER_COLLECTIVES[name]
        signature = inspect.signature(function)

        def counted(*args, **kwargs):
            call = signature.bind(*args, **kwargs).arguments
            tensor = call[full_tensor]
            n = dist.get_world_size(call.get("group"))
            entry = counter.steps[counter.step]
            entry["other_calls"] += 1
            entry["other_ring_bytes"] += factor(n) * tensor.numel() * tensor.element_size()
            return function(*args, **kwargs)

        return counted

    def sync(self) -> None:
        if self.device_type == "cuda":
            import torch

            torch.cuda.synchronize()


def worker(args) -> None:
    import torch

    from meshtron.cli import main as meshtron_main
    from meshtron.models.presets import PRESETS

    PRESETS[PRESET] = preset_settings(args)
    rank = int(os.environ.get("RANK", "0"))
    counter = AllToAllCounter("cuda" if args.device == "cuda" else "cpu")
    counter.install(args.count_collectives)
    output = args.run_dir / "run"
    command = ["train", *[f"--{o}" for o in overrides(args, args.nproc, args.ep, output)]]
    code = meshtron_main(command)
    if code != 0:
        raise RuntimeError("meshtron train failed")
    counted = range(args.warmup, args.steps)  # optimizer steps after warm-up (0-based)
    mine = {
        "rank": rank,
        "ep_ranks": counter.ep_ranks,
        "group_sizes": sorted(counter.group_sizes),
        "steps": {step: dict(counter.steps.get(step, {})) for step in counted},
        "calls_by_step": [counter.steps.get(step, {}).get("calls", 0) for step in range(args.steps)],
    }
    (args.run_dir / f"rank{rank}.json").write_text(json.dumps(mine))
    torch.save({step: counter.routing.get(step, []) for step in counted}, args.run_dir / f"routing{rank}.pt")
    if rank == 0:
        metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        (args.run_dir / "result.json").write_text(json.dumps({"metrics": metrics, "threads": torch.get_num_threads()}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are written; skip interpreter teardown (as bench/tensor_parallel.py)


# ---------------------------------------------------------------------------------------------- main


def analyse(args, nproc: int, ep: int, run_dir: Path, raw: dict, wall_s: float) -> dict:
    import torch

    from meshtron.distributed.expert_parallel import all_to_all_traffic

    metrics = raw["metrics"]
    rates = [m["tokens_per_s"] for m in metrics[args.warmup :]]
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    routing = [torch.load(run_dir / f"routing{r}.pt") for r in range(nproc)]
    counted = list(range(args.warmup, args.steps))
    per_rank = []  # per rank: means over counted steps
    ratios = []
    pairs_total = off_rank_rows = 0
    for r in range(nproc):
        steps = ranks[r]["steps"]
        mean = {
            key: statistics.mean(steps[str(s)].get(key, 0.0) for s in counted)
            for key in (
                "calls",
                "count_bytes",
                "tensor_bytes",
                "fwd_off_rank_bytes",
                "bwd_off_rank_bytes",
                "count_seconds",
                "token_seconds",
                "other_calls",
                "other_ring_bytes",
            )
        }
        predicted, shares = [], []
        if ep > 1:
            group = ranks[r]["ep_ranks"]
            me = group.index(r)
            for s in counted:
                layers = len(routing[r][s])
                total = 0
                for layer in range(layers):
                    traffic = all_to_all_traffic(
                        [routing[g][s][layer] for g in group], args.experts, args.hidden, args.element_size
                    )
                    total += traffic.sent_bytes(me)
                    off_rank_rows += sum(n for dst, n in enumerate(traffic.rows[me]) if dst != me)
                    pairs_total += sum(traffic.rows[me])
                    computed = sum(row[me] for row in traffic.rows)  # rows this rank's experts compute
                    shares.append(computed / max(sum(map(sum, traffic.rows)), 1))
                predicted.append(total)
                measured = steps[str(s)].get("fwd_off_rank_bytes", 0.0) + steps[str(s)].get("bwd_off_rank_bytes", 0.0)
                ratios.append(measured / total if total else float("nan"))
        mean["predicted_bytes"] = statistics.mean(predicted) if predicted else 0.0
        mean["off_rank_bytes"] = mean["fwd_off_rank_bytes"] + mean["bwd_off_rank_bytes"]
        mean["seconds"] = mean["count_seconds"] + mean["token_seconds"]
        mean["expert_rows_share"] = statistics.mean(shares) if shares else 1.0
        per_rank.append(mean)
    layers_seen = len(routing[0][counted[0]])
    return {
        "nproc": nproc,
        "ep": ep,
        "experts_per_rank": args.experts // ep,
        "launch_wall_s": wall_s,
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s": rates,
        "step_s_median": statistics.median(args.batch * args.seq_len / rate for rate in rates),
        "losses": [m["loss"] for m in metrics],
        "max_memory_gb_rank0": metrics[-1].get("max_memory_gb"),
        "moe_layer_calls_per_step": layers_seen,
        "calls_per_step_max": max(p["calls"] for p in per_rank),
        "off_rank_bytes_per_step_max": max(p["off_rank_bytes"] for p in per_rank),
        "off_rank_bytes_per_step_mean": statistics.mean(p["off_rank_bytes"] for p in per_rank),
        "predicted_bytes_per_step_max": max(p["predicted_bytes"] for p in per_rank),
        "measured_over_predicted": [min(ratios), max(ratios)] if ratios else None,
        "off_rank_share": off_rank_rows / pairs_total if pairs_total else 0.0,
        "expert_rows_share_max": max(p["expert_rows_share"] for p in per_rank),
        "count_bytes_per_step_max": max(p["count_bytes"] for p in per_rank),
        "tensor_bytes_per_step_max": max(p["tensor_bytes"] for p in per_rank),
        "a2a_seconds_per_step_max": max(p["seconds"] for p in per_rank),
        "a2a_seconds_per_step_min": min(p["seconds"] for p in per_rank),
        "count_seconds_per_step_max": max(p["count_seconds"] for p in per_rank),
        "token_seconds_per_step_max": max(p["token_seconds"] for p in per_rank),
        "other_collective_bytes_per_step_max": (
            max(p["other_ring_bytes"] for p in per_rank) if args.count_collectives else None
        ),
        "other_collective_calls_per_step_max": max(p["other_calls"] for p in per_rank),
        "per_rank": per_rank,
        "calls_by_step_rank0": ranks[0]["calls_by_step"],
        "group_sizes": ranks[0]["group_sizes"],
    }


def markdown_table(results: list[dict], cores: int) -> str:
    lines = [
        "| N procs | ep | experts/rank | tok/s (median) | step s | a2a calls/step/rank | a2a MB off-rank/step/rank "
        "(measured, max rank) | predicted MB (`all_to_all_traffic`) | measured / predicted | off-rank share of "
        "routed rows | busiest rank's share of its EP group's expert rows | a2a s/step, max rank (counts + tokens) "
        "| a2a s/step, min rank | other collectives MB/step/rank (ring est.) | "
        "final loss | tok/s per round |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        over = " (oversubscribed)" if r["nproc"] > cores else ""
        ratio = r["measured_over_predicted"]
        ratio_s = (
            "-" if ratio is None else (f"{ratio[0]:.4f}" if ratio[0] == ratio[1] else f"{ratio[0]:.4f}-{ratio[1]:.4f}")
        )
        ep1 = r["ep"] == 1
        other = r["other_collective_bytes_per_step_max"]
        seconds = (
            f"{r['a2a_seconds_per_step_max']:.3f} ({r['count_seconds_per_step_max']:.3f} + "
            f"{r['token_seconds_per_step_max']:.3f})"
        )
        lines.append(
            f"| {r['nproc']}{over} | {r['ep']} | {r['experts_per_rank']} | {r['tokens_per_s_median']:,.0f} | "
            f"{r['step_s_median']:.3f} | {r['calls_per_step_max']:g} | "
            f"{'0' if ep1 else format(r['off_rank_bytes_per_step_max'] / 1e6, '.3f')} | "
            f"{'-' if ep1 else format(r['predicted_bytes_per_step_max'] / 1e6, '.3f')} | {ratio_s} | "
            f"{'-' if ep1 else format(r['off_rank_share'], '.3f')} | "
            f"{'-' if ep1 else format(r['expert_rows_share_max'], '.3f')} | {'-' if ep1 else seconds} | "
            f"{'-' if ep1 else format(r['a2a_seconds_per_step_min'], '.3f')} | "
            f"{'-' if other is None else format(other / 1e6, '.2f')} | {r['losses'][-1]:.4f} | "
            + " / ".join(f"{x['tokens_per_s_median']:,.0f}" for x in r.get("rounds", [r]))
            + " |"
        )
    return "\n".join(lines)


def prepare_data(args) -> None:
    """Tokenize and pack once before the launches, so that no launch pays for it."""
    from meshtron.config import load_config
    from meshtron.data.dataset import build_packed_dataset
    from meshtron.data.tokenizer import load_tokenizer

    cfg = load_config(None, [o for o in overrides(args, 1, 1, Path("unused")) if not o.startswith("model.")], env={})
    build_packed_dataset(cfg.data, load_tokenizer(cfg.data.tokenizer), is_builder=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[2, 4],
        help="world sizes N, each a dp_shard=N launch (not --nproc: torchrun would take it)",
    )
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4], help="ep degrees (those dividing N run)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--moe-intermediate", type=int, default=256, help="each expert's FFN width")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (every one a sparse MoE block)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps left out of every figure")
    parser.add_argument("--rounds", type=int, default=3, help="launches per layout (medians over rounds)")
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="run.device (cuda: NCCL)")
    parser.add_argument("--mixed-precision", default="none", help="precision.mixed_precision: none, bf16, fp16")
    parser.add_argument("--compile", default="false", help="train.compile (EP's host sync breaks the graph)")
    parser.add_argument(
        "--no-collective-count",
        dest="count_collectives",
        action="store_false",
        help="do not wrap FSDP's all-gather / reduce-scatter and all-reduce to count their bytes",
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each launch, wait up to this long for other processes to leave the CPUs",
    )
    parser.add_argument("--cache-dir", help="tokenized-data cache (default ~/.cache/meshtron)")
    parser.add_argument("--out", type=Path, help="write the JSON results here (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-nproc", dest="nproc_one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-ep", dest="ep_one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup or args.warmup < 1:
        parser.error(f"need 1 <= --warmup < --steps, got --warmup {args.warmup} --steps {args.steps}")
    args.element_size = 2 if args.mixed_precision in ("bf16", "fp16") else 4
    if args.worker:
        args.nproc, args.ep = args.nproc_one, args.ep_one  # this launch's layout
        return worker(args)
    bad = [ep for ep in args.ep if args.experts % ep]
    if bad:
        parser.error(f"--ep {bad} must divide --experts {args.experts}")
    layouts = [(n, ep) for n in args.world for ep in args.ep if n % ep == 0 and args.batch % n == 0]
    if not layouts:
        parser.error("no layout: every ep must divide some N, and N the global batch")
    prepare_data(args)
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-ep-bench-"))
    cores = os.cpu_count() or 1
    runs: dict[tuple[int, int], list[dict]] = {layout: [] for layout in layouts}
    for index in range(args.rounds):  # alternate the order, so that drift in machine speed hits all alike
        for n, ep in layouts if index % 2 == 0 else reversed(layouts):
            name = f"round{index + 1}-n{n}-ep{ep}"
            waited, busy = wait_for_idle(args.wait_idle) if args.wait_idle else (0.0, other_tasks())
            started = time.time()
            raw = launch_workers(
                __file__,
                n,
                workdir / name,
                ["--worker-nproc", str(n), "--worker-ep", str(ep)],
                log=workdir / f"{name}.log",
            )
            r = analyse(args, n, ep, workdir / name, raw, time.time() - started)
            r["other_tasks_before"], r["waited_s"] = busy, waited
            runs[(n, ep)].append(r)
            print(
                f"round {index + 1} N={n} ep={ep}: {r['tokens_per_s_median']:,.0f} tok/s, "
                f"step {r['step_s_median']:.3f}s, "
                f"all-to-all {r['off_rank_bytes_per_step_max'] / 1e6:.3f} MB off-rank/step/rank (predicted "
                f"{r['predicted_bytes_per_step_max'] / 1e6:.3f}), {r['a2a_seconds_per_step_max']:.3f} s/step, "
                f"launch {r['launch_wall_s']:.0f}s, other tasks before {'-' if busy is None else f'{busy:.1f}'} "
                f"(waited {waited:.0f}s), load after {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    results = []
    for rounds in runs.values():
        merged = dict(rounds[0])  # bytes and losses are the same in every round (same data, seeds, routing)
        for key in (
            "tokens_per_s_median",
            "step_s_median",
            "a2a_seconds_per_step_max",
            "a2a_seconds_per_step_min",
            "count_seconds_per_step_max",
            "token_seconds_per_step_max",
        ):
            merged[key] = statistics.median(r[key] for r in rounds)
        merged["rounds"] = [
            {
                key: r[key]
                for key in (
                    "tokens_per_s_median",
                    "step_s_median",
                    "a2a_seconds_per_step_max",
                    "off_rank_bytes_per_step_max",
                    "launch_wall_s",
                    "other_tasks_before",
                )
            }
            for r in rounds
        ]
        results.append(merged)
    summary = {
        "model": dict(preset_settings(args), derived_from="qwen3moe-tiny"),
        "seq_len": args.seq_len,
        "global_batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "device": args.device,
        "mixed_precision": args.mixed_precision,
        "cpu_cores": cores,
        "element_size": args.element_size,
        "results": results,
    }
    print(markdown_table(results, cores))
    out = args.out or workdir / "experts.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out} (worker logs beside it)")


if __name__ == "__main__":
    main()
