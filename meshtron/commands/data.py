"""``meshtron data prepare ...``: tokenize a corpus into a prepared directory (meshtron.data.cli)."""

from __future__ import annotations

import argparse

from meshtron.data.cli import add_data_parser

NAMES = ("data",)


def add_parser(sub) -> None:
    add_data_parser(sub)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.data.cli import run_data

    return run_data(args, extra)
