"""One module per ``meshtron`` command, each with ``NAMES`` (the subcommands it adds), ``add_parser(subparsers)``
and ``run(args, extra) -> int`` (``extra``: the arguments its parser left, e.g. ``--section.key=value`` settings).
``meshtron.cli`` builds the parser from ``COMMANDS`` and runs the one named. Parsing imports neither torch nor
transformers: a command imports what it needs when it runs."""

from __future__ import annotations

from types import ModuleType

from meshtron.commands import check, data, evaluate, export, generate, plan, runs, train

COMMANDS: tuple[ModuleType, ...] = (train, evaluate, export, generate, plan, check, data, runs)
"""In the order ``meshtron --help`` lists them. A new command: its module here, and a line in the README."""


def command_named(name: str) -> ModuleType:
    """The module of the subcommand ``name``."""
    return next(command for command in COMMANDS if name in command.NAMES)
