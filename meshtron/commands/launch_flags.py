"""The flags that ``meshtron train`` and ``meshtron eval`` share for starting their workers (meshtron.launch)."""

from __future__ import annotations

import argparse

from meshtron.launch import RANK_STARTS


def add_launch_flags(command: argparse.ArgumentParser) -> None:
    """``--nproc``, ``--master-port`` and ``--rank-start``."""
    command.add_argument("--nproc", type=int, help="launch this many processes on this machine")
    command.add_argument("--master-port", type=int, default=None, help="rendezvous port for --nproc (default: free)")
    command.add_argument(
        "--rank-start",
        choices=RANK_STARTS,
        help="with --nproc: fork each worker from a process that imported torch and transformers once (forkserver, "
        "the default), or start each as a new interpreter, as torchrun does (fresh)",
    )
