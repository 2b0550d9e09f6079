"""Data parallelism on CPU: meshtron (DDP-style and FSDP2) vs a torch DDP loop and HF accelerate.

Every peer is its own ``torchrun`` launch of ``--nproc`` processes (gloo, ``OMP_NUM_THREADS=1`` each)
that trains the same model (meshtron's meta-device build and name-seeded init, so the same weights),
on the same packed data (meshtron's ``GlobalBatchSchedule``, each rank its contiguous slice of the
global batch), with the same AdamW (decay on matrices only), warmup + cosine schedule, gradient
clipping at 1.0 and loss (mean over the global batch's target tokens), in fp32 with plain causal
attention (``data.mask_documents=false`` for meshtron, so that all four compute the same thing;
``--mask-documents`` times meshtron's default document masks instead):

* ``meshtron-ddp``: ``meshtron train --parallel.dp_replicate=N --parallel.dp_shard=1``;
* ``meshtron-fsdp``: ``meshtron train --parallel.dp_shard=N`` (FSDP2);
* ``ddp``: a hand-written loop around ``torch.nn.parallel.DistributedDataParallel``;
* ``accelerate``: the same loop through ``Accelerator(cpu=True)`` (``pip install accelerate``; the peer
  is skipped with a message when it is missing). Plain ``Accelerator()`` under torchrun on a machine
  without GPUs silently trains unsynchronized copies on CPU; ``cpu=True`` makes it use gloo and DDP.

Rounds alternate the order of the peers (forward, then backward), so drift in machine speed hits all
alike. Times are wall clock on rank 0: start-up runs from the launch of torchrun to the first forward
(interpreter, imports, process group, data, model build), the first step from there to the end of the
first optimizer step, and tokens/s spans the optimizer steps after the first ``--warmup`` ones (loop
overhead, data and logging included). The table gives medians over rounds. Example:

    python bench/data_parallel.py                      # llama-small, seq 256, global batch 16, 6 rounds
    python bench/data_parallel.py --rounds 2 --steps 12 --peers meshtron-ddp ddp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launch import launch_workers  # bench/launch.py (this script's folder is on sys.path)

PEERS = ("meshtron-ddp", "meshtron-fsdp", "ddp", "accelerate")
ACCELERATE_MISSING = "accelerate is not installed (pip install accelerate); skipping the accelerate peer"


def common_overrides(args) -> list[str]:
    return (
        [
            f"model.preset={args.preset}",
            f"data.seq_len={args.seq_len}",
            f"data.max_documents={args.documents}",
            f"data.mask_documents={str(args.mask_documents).lower()}",
            f"train.steps={args.steps}",
            f"train.global_batch_size={args.batch}",
            "schedule.warmup_steps=2",
        ]
        + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
        + cpu_override()
    )


def cpu_override() -> list[str]:
    """``run.device=cpu`` where meshtron has that setting (elsewhere it picks CUDA when it sees a GPU)."""
    from dataclasses import fields

    from meshtron.config import RunConfig

    return ["run.device=cpu"] if "device" in {f.name for f in fields(RunConfig)} else []


def load_run_config(args):
    from meshtron.config import load_config

    return load_config(None, common_overrides(args), env={})


class StepClock:
    """Wall-clock marks on this process: the first module forward and the end of every optimizer step."""

    def __init__(self):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.first_forward: float | None = None
        self.step_ends: list[float] = []
        self._forward = torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)
        self._step = register_optimizer_step_post_hook(lambda *_: self.step_ends.append(time.time()))

    def _on_forward(self, module, inputs) -> None:
        self.first_forward = time.time()
        self._forward.remove()


def run_meshtron(args, layout: list[str]) -> list[float]:
    """``meshtron train`` exactly as a user starts it under torchrun; returns rank 0's logged losses."""
    from meshtron.cli import main as meshtron_main

    output = args.run_dir / "meshtron"
    overrides = [f"--{o}" for o in common_overrides(args) + layout] + [
        "--run.progress=false",
        f"--run.output_dir={output}",
    ]
    if meshtron_main(["train", *overrides]) != 0:
        raise RuntimeError("meshtron train failed")
    if os.environ.get("RANK", "0") != "0":
        return []
    return [json.loads(line)["loss"] for line in (output / "metrics.jsonl").read_text().splitlines()]


def run_loop(args, use_accelerate: bool) -> list[float]:
    """The loop a user writes around DDP (or accelerate): same model, data, optimizer, schedule and loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshtron.data.dataset import build_packed_dataset
    from meshtron.data.sampler import GlobalBatchSchedule
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.train.optim.build import lr_at

    if use_accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        if accelerator.num_processes != int(os.environ["WORLD_SIZE"]):
            raise RuntimeError(f"accelerate runs {accelerator.num_processes} process(es) of {os.environ['WORLD_SIZE']}")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_run_config(args)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    dataset = build_packed_dataset(
        cfg.data, tokenizer, is_builder=int(os.environ["LOCAL_RANK"]) == 0, barrier=dist.barrier
    )
    schedule = GlobalBatchSchedule(len(dataset), cfg.train.global_batch_size, cfg.data.shuffle, cfg.data.seed)
    model, adapter = build_meta_model(load_hf_config(cfg.model, tokenizer.vocab_size), cfg.model)
    materialize(model, adapter, torch.device("cpu"), seed=cfg.train.seed)
    model.train()
    t, o = cfg.train, cfg.optimizer
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / o.lr)
    if use_accelerate:  # the scheduler stays outside: accelerate would step it once per process
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    per_rank = t.global_batch_size // world
    losses = []
    for step in range(t.steps):
        input_ids, labels = dataset.batch(schedule.global_batch(step)[rank * per_rank : (rank + 1) * per_rank])
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        if use_accelerate:
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    mean = torch.stack(losses)  # every rank has as many targets, so the mean of the rank means is the global mean
    dist.all_reduce(mean)
    dist.destroy_process_group()
    return (mean / world).tolist()


def worker(args) -> None:
    import torch

    clock = StepClock()
    if args.peer == "meshtron-ddp":
        losses = run_meshtron(args, [f"parallel.dp_replicate={args.nproc}", "parallel.dp_shard=1"])
    elif args.peer == "meshtron-fsdp":
        losses = run_meshtron(args, [f"parallel.dp_shard={args.nproc}"])
    else:
        losses = run_loop(args, use_accelerate=args.peer == "accelerate")
    if os.environ.get("RANK", "0") == "0":
        result = {
            "first_forward": clock.first_forward,
            "step_ends": clock.step_ends,
            "losses": losses,
            "threads": torch.get_num_threads(),
        }
        args.run_dir.mkdir(parents=True, exist_ok=True)
        (args.run_dir / "result.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are written; skip interpreter teardown


def measure(raw: dict, launched: float, tokens_per_step: int, warmup: int) -> dict:
    ends = raw["step_ends"]
    return {
        "tokens_per_s": tokens_per_step * (len(ends) - warmup) / (ends[-1] - ends[warmup - 1]),
        "first_step_s": ends[0] - raw["first_forward"],
        "startup_s": raw["first_forward"] - launched,
        "final_loss": raw["losses"][-1],
        "threads": raw["threads"],
    }


def markdown_table(medians: dict[str, dict], per_round: dict[str, list[dict]]) -> str:
    ddp = medians.get("ddp", {}).get("tokens_per_s")
    acc = medians.get("accelerate", {}).get("tokens_per_s")
    lines = [
        "| peer | tok/s | vs DDP | vs accelerate | first step s | start-up s | final loss | tok/s per round |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, m in medians.items():
        rate = m["tokens_per_s"]
        rounds = " / ".join(f"{r['tokens_per_s']:,.0f}" for r in per_round[name])
        vs_ddp = f"{rate / ddp:.2f}" if ddp else "-"
        vs_acc = f"{rate / acc:.2f}" if acc else "-"
        lines.append(
            f"| {name} | {rate:,.0f} | {vs_ddp} | {vs_acc} | {m['first_step_s']:.2f} | {m['startup_s']:.1f} | "
            f"{m['final_loss']:.4f} | {rounds} |"
        )
    return "\n".join(lines)


def other_tasks(samples: int = 10, interval: float = 0.1) -> float | None:
    """Mean number of other runnable tasks on the machine over ``samples * interval`` seconds (Linux's
    /proc/loadavg, less this process); None where that file does not exist."""
    counts = []
    for _ in range(samples):
        try:
            running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        except OSError:
            return None
        counts.append(int(running) - 1)
        time.sleep(interval)
    return sum(counts) / len(counts)


def wait_for_idle(limit_s: float, threshold: float = 0.5) -> tuple[float, float | None]:
    """Wait up to ``limit_s`` seconds until other processes leave the CPUs alone (a shared machine);
    returns (seconds waited, other runnable tasks at the start of the run)."""
    started = time.time()
    busy = other_tasks()
    while busy is not None and busy > threshold and time.time() - started < limit_s:
        time.sleep(2)
        busy = other_tasks()
    return time.time() - started, busy


def prepare_data(args) -> None:
    """Tokenize and pack once before the rounds, so that no peer's start-up pays for it."""
    from meshtron.data.dataset import build_packed_dataset
    from meshtron.data.tokenizer import load_tokenizer

    cfg = load_run_config(args)
    build_packed_dataset(cfg.data, load_tokenizer(cfg.data.tokenizer), is_builder=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps left out of tokens/s")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--documents", type=int, default=600)
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--mask-documents", action="store_true", help="meshtron with its default document masks")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs",
    )
    parser.add_argument("--cache-dir", help="tokenized-data cache (default ~/.cache/meshtron)")
    parser.add_argument("--out", type=Path, help="write the JSON results here (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup or args.warmup < 1:
        parser.error(f"need 1 <= --warmup < --steps, got --warmup {args.warmup} --steps {args.steps}")
    if args.worker:
        return worker(args)
    peers = list(args.peers)
    if "accelerate" in peers:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            print(ACCELERATE_MISSING, flush=True)
            peers.remove("accelerate")
    prepare_data(args)
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-dp-bench-"))
    per_round: dict[str, list[dict]] = {name: [] for name in peers}
    loads = [os.getloadavg()[0]]
    for index in range(args.rounds):
        for name in peers if index % 2 == 0 else reversed(peers):
            run_dir = workdir / f"round{index + 1}-{name}"
            waited, busy = wait_for_idle(args.wait_idle) if args.wait_idle else (0.0, other_tasks())
            launched = time.time()
            raw = launch_workers(
                __file__, args.nproc, run_dir, ["--peer", name], log=workdir / f"round{index + 1}-{name}.log"
            )
            r = measure(raw, launched, args.batch * args.seq_len, args.warmup)
            per_round[name].append(r)
            loads.append(os.getloadavg()[0])
            print(
                f"round {index + 1} {name:>13}: {r['tokens_per_s']:8,.0f} tok/s | first step "
                f"{r['first_step_s']:.2f}s | "
                f"start-up {r['startup_s']:.1f}s | final loss {r['final_loss']:.4f} | other tasks before "
                f"{'-' if busy is None else f'{busy:.1f}'} (waited {waited:.0f}s), load after {loads[-1]:.1f}",
                flush=True,
            )
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in per_round.items()
    }
    summary = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "global_batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "nproc": args.nproc,
        "mask_documents": args.mask_documents,
        "cpu_cores": os.cpu_count(),
        "load_average_1min": loads,
        "medians": medians,
        "per_round": per_round,
    }
    print(markdown_table(medians, per_round))
    print(f"1-minute load average during the rounds: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores")
    out = args.out or workdir / "data_parallel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"results: {out} (worker logs beside it)")


if __name__ == "__main__":
    main()
