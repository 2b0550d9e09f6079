"""Issue 58, item 1: below the ``train`` layer no function takes the whole ``Config``; each takes the section or the
small resolved options it needs (``ParallelizeOptions``, ``CheckpointOptions``, ``PrecisionConfig``, ``RunConfig``,
...); and no production code assigns to a setting once preflight has run. Read from the source (the AST), so a new
function that takes ``cfg: Config``, or a new ``cfg.<section>.<key> = ...``, fails here, with its place."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from meshtron.config import Config

PACKAGE = Path(__file__).resolve().parents[1] / "meshtron"
BELOW_TRAIN = ("data", "models", "distributed", "checkpoint", "metrics", "resilience")
"""The packages under the train layer (pyproject.toml's import-linter layers), besides config / errors / tensors."""


def _takes_the_config(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A parameter annotated ``Config`` (or ``"Config"``), or named ``cfg`` without an annotation (``config`` alone is
    a Hugging Face model config in meshtron)."""
    arguments = function.args
    for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
        annotation = arg.annotation
        name = None
        if isinstance(annotation, ast.Name):
            name = annotation.id
        elif isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            name = annotation.value
        if name == "Config" or (annotation is None and arg.arg == "cfg"):
            return True
    return False


def _functions_taking_the_config() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for package in BELOW_TRAIN:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _takes_the_config(node):
                    found.setdefault(str(path.relative_to(PACKAGE)), set()).add(node.name)
    return found


def test_no_function_below_the_train_layer_takes_the_whole_config():
    found = {path: sorted(names) for path, names in _functions_taking_the_config().items()}
    assert not found, f"these take the whole Config; pass the section or resolved options they need: {found}"


SECTIONS = frozenset(field.name for field in dataclasses.fields(Config))
"""The Config's sections ([model], [data], [train], ...): ``<anything>.<section>.<key> = ...`` assigns a setting."""

ASSIGNING_BEFORE_PREFLIGHT = {
    "plan/layout.py": {"write_to"},
}
"""Production code that assigns settings, allowed because it runs before any preflight: ``Layout.write_to`` writes a
layout the planner proposes into a config being made (``meshtron plan --emit-config``, the planner's and check's
configs), which is then loaded or preflighted as given. ``config.py`` is left out whole: loading and resolving the
settings is what makes them."""


def _enclosing_functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each assignment statement's innermost enclosing function's name (``<module>`` at the top level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else name
            if isinstance(child, ast.Assign | ast.AugAssign | ast.AnnAssign):
                owner[child] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _assigned_settings(statement: ast.AST) -> list[str]:
    """The ``<section>.<key>`` targets that ``statement`` assigns (tuple targets included)."""
    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
    return [
        f"{node.value.attr}.{node.attr}"
        for target in targets
        for node in ast.walk(target)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr in SECTIONS
    ]


def _settings_assigned() -> dict[str, list[str]]:
    """``{path: ["function: section.key", ...]}`` of every assignment to a setting in meshtron/ but config.py."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if name == "config.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement, function in _enclosing_functions(tree).items():
            for setting in _assigned_settings(statement):
                found.setdefault(name, []).append(f"{function} (line {statement.lineno}): {setting}")
    return found


def test_no_production_code_assigns_a_setting_after_preflight():
    """Issue 58, item 1: a run's settings are what was given, resolved once (the output directory, the hub commit:
    a copy by dataclasses.replace, meshtron.train.setup.run_setup.resolved_config), never changed in place, so that what
    a function reads of them is what every other function reads."""
    found = _settings_assigned()
    unexpected = {
        path: [line for line in lines if line.split(" ")[0] not in ASSIGNING_BEFORE_PREFLIGHT.get(path, set())]
        for path, lines in found.items()
    }
    unexpected = {path: lines for path, lines in unexpected.items() if lines}
    assert not unexpected, (
        f"these assign a setting; make a copy (dataclasses.replace) or a resolved value: {unexpected}"
    )
    stale = {
        path: sorted(names - {line.split(" ")[0] for line in found.get(path, [])})
        for path, names in ASSIGNING_BEFORE_PREFLIGHT.items()
    }
    stale = {path: names for path, names in stale.items() if names}
    assert not stale, f"no longer assign a setting: remove them from ASSIGNING_BEFORE_PREFLIGHT: {stale}"


def test_the_assignment_scan_sees_assignments_to_settings():
    """The scan's own check: what it must find, and what it must leave alone."""
    found = [
        setting
        for statement in ast.walk(ast.parse(SCAN_EXAMPLES))
        if isinstance(statement, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for setting in _assigned_settings(statement)
    ]
    assert found == ["run.output_dir", "model.revision", "train.steps", "data.seq_len"]


SCAN_EXAMPLES = """
cfg.run.output_dir = "out"
self.cfg.model.revision, other = "abc", 1
cfg.train.steps += 1
job.settings.data.seq_len: int = 8
cfg.run = run  # a whole section: replaced, not changed in place
self.model = model  # an attribute called like a section
cfg.optimizer.settings["muon"] = {}  # not an attribute: a subscript
"""
