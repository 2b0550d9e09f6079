"""Issue 58, item 1: below the ``train`` layer no function takes the whole ``Config``; each takes the section or the
small resolved options it needs (``ParallelizeOptions``, ``PrecisionConfig``, ``RunConfig``, ...). Read from the
source (the AST), so a new function that takes ``cfg: Config`` fails here, with its place."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "meshtron"
BELOW_TRAIN = ("data", "models", "distributed", "checkpoint", "metrics", "resilience")
"""The packages under the train layer (pyproject.toml's import-linter layers), besides config / errors / tensors."""

STILL_TAKING_THE_CONFIG = {
    "checkpoint/earlier_runs.py": {"model_settings", "find_earlier_run", "earlier_run_notice"},
    "checkpoint/manager.py": {
        "checkpoint_directory",
        "check_fixed_directory",
        "hub_revision",
        "recorded_revision",
        "lora_base",
        "check_lora_checkpoint",
        "checkpoint_meta",
        "resume_point",
    },
    "resilience/guard.py": {"__init__"},
}
"""Not done yet (issue 58): the checkpoint manager's and the run guard's functions. Remove an entry when its function
takes what it needs; the test fails on an entry that no longer takes the whole Config, so this list only shrinks."""


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
    found = _functions_taking_the_config()
    new = {path: names - STILL_TAKING_THE_CONFIG.get(path, set()) for path, names in found.items()}
    new = {path: sorted(names) for path, names in new.items() if names}
    assert not new, f"these take the whole Config; pass the section or resolved options they need: {new}"
    done = {path: sorted(names - found.get(path, set())) for path, names in STILL_TAKING_THE_CONFIG.items()}
    done = {path: names for path, names in done.items() if names}
    assert not done, f"no longer take the whole Config: remove them from STILL_TAKING_THE_CONFIG: {done}"
