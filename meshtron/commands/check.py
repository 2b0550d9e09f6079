"""``meshtron check [--nproc N]``: a tiny model trained under every layout N ranks can host, each compared with one
process (meshtron.check, docs/new-cluster.md)."""

from __future__ import annotations

import argparse

from meshtron.check.cli import add_check_parser
from meshtron.errors import ConfigError

NAMES = ("check",)


def add_parser(sub) -> None:
    add_check_parser(sub)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"unexpected arguments {extra}; see meshtron check --help")
    from meshtron.check.cli import run_check_command

    return run_check_command(args)
