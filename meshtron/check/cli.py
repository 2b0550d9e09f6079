"""``meshtron check [--nproc N] [--only NAMES] [--steps S] [--device auto|cpu|cuda]`` (docs/new-cluster.md)."""

from __future__ import annotations

import argparse

from meshtron.check.layouts import DEFAULT_STEPS

CHECK_USAGE = "meshtron check [--nproc N] [--only NAMES] [--steps S] [--device auto|cpu|cuda]"


def add_check_parser(sub) -> None:
    check = sub.add_parser(
        "check",
        help="train a tiny model a few steps under every layout N processes can host and compare each with one "
        "process (run it on a new cluster before a long job)",
        usage=CHECK_USAGE,
        description="Trains a tiny Llama (and a tiny mixture of experts for expert parallelism) a few steps under "
        "every layout N ranks can host (DDP, FSDP, HSDP, TP, CP ring and Ulysses, PP, EP and their combinations), "
        "each on fresh processes, and compares losses, gradient norms and final weights with one process. Exits 1 "
        "when any layout differs. gloo on CPU, NCCL on GPUs (fp32, TF32 off); on one GPU, the GPU against the CPU. "
        "See docs/new-cluster.md.",
    )
    check.add_argument(
        "--nproc", type=int, help="processes (ranks) on this machine (default: every visible GPU, or 2 on CPU)"
    )
    check.add_argument("--only", help="comma-separated layout names to run (e.g. fsdp2,tp2); default: all")
    check.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per run (default {DEFAULT_STEPS})"
    )
    check.add_argument(
        "--device", default="auto", help="auto (GPUs when visible), cpu (gloo) or cuda (NCCL); default auto"
    )


def run_check_command(args: argparse.Namespace) -> int:
    from meshtron.check.runner import run_check

    return run_check(args.nproc, only=args.only, steps=args.steps, device=args.device)
