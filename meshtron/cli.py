"""The ``meshtron`` command line: the parser built from the commands' registry (meshtron.commands: ``train``,
``eval``, ``export``, ``generate``, ``plan``, ``check``, ``data``, ``plot``, ``compare``, one module each) and the
dispatch to the command named. A command's error is said in one line (meshtron.exits)."""

from __future__ import annotations

import argparse
import sys

from meshtron.commands import COMMANDS, command_named
from meshtron.commands.version import version_line
from meshtron.errors import MeshtronError
from meshtron.exits import exit_after, report_error
from meshtron.known_noise import quiet_known_noise


def build_parser() -> argparse.ArgumentParser:
    """``meshtron``'s parser: ``--version`` and one subcommand per entry of the registry."""
    parser = argparse.ArgumentParser(prog="meshtron", description="Train causal language models in parallel.")
    parser.add_argument("--version", action="store_true", help="print meshtron's, torch's and transformers' versions")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``meshtron ARGV`` (default: the process's arguments); its exit status, an error's after its one line."""
    quiet_known_noise()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:  # before the parser, which wants a command
        print(version_line())
        return 0
    args, extra = build_parser().parse_known_args(argv)
    if args.version:
        print(version_line())
        return 0
    try:
        return command_named(args.command).run(args, extra)
    except MeshtronError as err:
        return report_error(err)


def run() -> None:
    """The ``meshtron`` command (and ``python -m meshtron``): ``main`` with its exit status (meshtron.exits)."""
    exit_after(main)


if __name__ == "__main__":
    run()
