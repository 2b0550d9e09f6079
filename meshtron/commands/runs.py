"""``meshtron plot RUN_DIR ...`` and ``meshtron compare RUN_A RUN_B``: look at runs and set them side by side
(meshtron.metrics.cli)."""

from __future__ import annotations

import argparse

from meshtron.errors import ConfigError
from meshtron.metrics.cli import add_runs_parsers

NAMES = ("plot", "compare")


def add_parser(sub) -> None:
    add_runs_parsers(sub)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"unexpected arguments {extra}; see meshtron {args.command} --help")
    from meshtron.metrics.cli import run_compare, run_plot

    return run_plot(args) if args.command == "plot" else run_compare(args)
