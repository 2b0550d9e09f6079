"""``meshtron plan ...``: rank the layouts that fit a model on a cluster (meshtron.plan.cli)."""

from __future__ import annotations

import argparse

from meshtron.errors import ConfigError
from meshtron.plan.cli import PLAN_USAGE, add_plan_parser

NAMES = ("plan",)


def add_parser(sub) -> None:
    add_plan_parser(sub)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"unexpected arguments {extra}; usage: {PLAN_USAGE}")
    from meshtron.plan.cli import run_plan

    return run_plan(args)
