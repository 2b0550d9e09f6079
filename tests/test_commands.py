"""The shape of the command line (CONTRIBUTING.md, "The layers"): one module per command behind the registry of
meshtron.commands, meshtron/cli.py only building the parser and dispatching, and one function that decides whether
torchrun started this process. Read from the source: no process is started."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "meshtron"
CLI_MOST_LINES = 60
CLI_FUNCTIONS = {"build_parser", "main", "run"}
TORCHRUN_VARIABLES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
}
"""What torchrun sets for each worker, any of which could tell a process that torchrun started it."""


def test_cli_builds_the_parser_and_dispatches_and_nothing_else():
    """A command's flags, policy and work live in its module of meshtron/commands/, not in cli.py."""
    source = (PACKAGE / "cli.py").read_text()
    tree = ast.parse(source)
    functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    classes = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    assert functions <= CLI_FUNCTIONS, f"cli.py defines {sorted(functions - CLI_FUNCTIONS)}: move them to a command"
    assert not classes, f"cli.py defines {classes}"
    assert len(source.splitlines()) <= CLI_MOST_LINES


def test_every_subcommand_has_one_module_in_the_registry():
    import argparse

    from meshtron.cli import build_parser
    from meshtron.commands import COMMANDS, command_named

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    subcommands = list(actions[0].choices)
    named = [name for command in COMMANDS for name in command.NAMES]
    assert named == subcommands  # in the registry's order, each once
    for command in COMMANDS:
        assert callable(command.add_parser) and callable(command.run), command.__name__
    assert command_named("compare").__name__ == "meshtron.commands.runs"


def _torchrun_checks(source: str, module: str) -> list[str]:
    """The functions of ``source`` that ask the environment whether one of torchrun's variables is set (``"X" in
    os.environ``, or ``os.environ.get("X")`` / ``os.getenv("X")`` compared with None), as ``module:function``."""
    tree = ast.parse(source)
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Compare) and _asks_for_a_torchrun_variable(node):
                found.append(f"{module}:{function.name}")
    return sorted(set(found))


def _asks_for_a_torchrun_variable(compare: ast.Compare) -> bool:
    sides = [compare.left, *compare.comparators]
    membership = any(isinstance(op, ast.In | ast.NotIn) for op in compare.ops)
    if membership and any(_is_environ(side) for side in sides):
        return any(isinstance(side, ast.Constant) and side.value in TORCHRUN_VARIABLES for side in sides)
    identity = any(isinstance(op, ast.Is | ast.IsNot) for op in compare.ops)
    return identity and any(_reads_a_torchrun_variable(side) for side in sides)


def _is_environ(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        or isinstance(node, ast.Name)
        and node.id == "environ"
    )


def _reads_a_torchrun_variable(node: ast.expr) -> bool:
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return False
    reader = node.func
    is_get = isinstance(reader, ast.Attribute) and (
        reader.attr == "getenv" or reader.attr == "get" and _is_environ(reader.value)
    )
    return is_get and node.args[0].value in TORCHRUN_VARIABLES


def test_one_function_decides_whether_torchrun_started_this_process():
    """It was decided three ways (cli.py and check/runner.py: RANK and WORLD_SIZE; distributed/runtime.py: RANK)."""
    deciders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        deciders += _torchrun_checks(path.read_text(), module)
    assert deciders == ["meshtron.distributed.torchrun_env:launched_by_torchrun"], deciders


def test_the_torchrun_check_sees_each_way_of_asking():
    """The scan above cannot pass by missing a spelling."""
    asks = {
        "a": 'import os\ndef a():\n    return "RANK" in os.environ\n',
        "b": 'import os\ndef b():\n    return "LOCAL_RANK" not in os.environ\n',
        "c": 'import os\ndef c():\n    return os.environ.get("WORLD_SIZE") is not None\n',
        "d": 'import os\ndef d():\n    return os.getenv("TORCHELASTIC_RUN_ID") is None\n',
        "e": 'import os\ndef e():\n    return "HOME" in os.environ and int(os.environ.get("RANK", "0"))\n',
    }
    found = [check for name, source in asks.items() for check in _torchrun_checks(source, name)]
    assert found == ["a:a", "b:b", "c:c", "d:d"]
