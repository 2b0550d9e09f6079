"""tools/check_import_cycles.py, which ``make lint`` runs: it finds modules importing each other in a circle."""

import importlib.util
from pathlib import Path

import grimp

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_import_cycles.py"


def _tool():
    spec = importlib.util.spec_from_file_location("check_import_cycles", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_circles_are_found_with_the_imports_that_close_them():
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a"), ("p.e", "p.e")]:
        graph.add_import(importer=importer, imported=imported, line_number=3, line_contents=f"import {imported}")
    graph.add_import(importer="p.f", imported="p.g", line_number=1, line_contents="import p.g")
    tool = _tool()
    assert tool.circles(graph) == [["p.a", "p.b", "p.c"], ["p.e"]]
    assert "p.c:3 -> p.a   (import p.a)" in tool.describe(graph, ["p.a", "p.b", "p.c"])


def test_meshtron_has_no_import_cycle(capsys):
    """Function-level imports count: they were how the circles cli <-> launch, distributed.mesh <->
    expert_parallel and train.preflight <-> train.moe hid."""
    code = _tool().main(["meshtron"])
    assert code == 0, capsys.readouterr().out
