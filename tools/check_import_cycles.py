"""Fails when modules of meshtron import each other in a circle (CONTRIBUTING.md, "Layers").

The import graph is grimp's (the one import-linter checks the layer contract on), which also sees imports made inside
functions. Each circle is printed as its files and the imports that close it, with their line numbers; exit status 1
when there is one, 0 otherwise. Run by ``make lint``: ``python tools/check_import_cycles.py [PACKAGE]``.
"""

from __future__ import annotations

import sys

import grimp


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The groups of modules that reach each other through imports (strongly connected components of two or more
    modules, or a module importing itself), each sorted, in a stable order (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1 or module in graph.find_modules_directly_imported_by(module):
                found.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(found)


def describe(graph: grimp.ImportGraph, group: list[str]) -> str:
    """One circle: its modules on one line, then each import between them (importer:line -> imported)."""
    lines = ["import cycle between " + ", ".join(group) + ":"]
    members = set(group)
    for importer in group:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer}:{detail['line_number']} -> {imported}   ({detail['line_contents']})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    package = argv[0] if argv else "meshtron"
    graph = grimp.build_graph(package, cache_dir=None)
    found = circles(graph)
    for group in found:
        print(describe(graph, group))
    if found:
        print(f"{len(found)} import cycle(s) in {package}: move what both sides need to the module that owns it")
        return 1
    print(f"no import cycle between the modules of {package}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
