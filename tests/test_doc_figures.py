"""Figures the docs quote from ``meshtron plan --max-seq-len`` equal what it prints now.

A page names each command once, in a comment ``<!-- plan-command NAME: ARGS -->`` (ARGS as typed after
``meshtron plan``), and marks each figure it quotes from it with a comment right after the number:
``324,608<!-- plan NAME FIELD -->``. FIELD is one of FIELDS. When the planner changes, regenerate every figure with

    PYTHONPATH=$PWD python tests/test_doc_figures.py --write
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/long-context.md", "BENCHMARKS.md")
COMMAND = re.compile(r"<!-- plan-command ([\w-]+): (.+?) -->")
FIGURE = re.compile(r"([0-9][0-9,.]*)<!-- plan ([\w-]+) (\w+) -->")
FIELDS = {
    "seq_len": lambda r: f"{r['seq_len']:,}",
    "gpu_gb": lambda r: f"{r['candidate']['memory_gb']['total']:.0f}",
    "host_gb": lambda r: f"{r['candidate']['memory_gb']['host']:.0f}",
    "tokens_per_s": lambda r: f"{r['candidate']['tokens_per_s_per_gpu']:,.0f}",
}
"""How each field is quoted: the length in tokens, GB per GPU on the device and in host memory, tokens/s per GPU."""


@cache
def plan_json(args: str) -> dict:
    """``meshtron plan ARGS --json``, run in this process."""
    from meshtron.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *shlex.split(args), "--json"])
    return json.loads(out.getvalue())


def quoted_figures(page: str):
    """(line, quoted, printed, command, field, match span) for every marked figure of ``page``; a mark whose command
    or field is unknown raises."""
    text = (ROOT / page).read_text()
    commands = dict(COMMAND.findall(text))
    marks, understood = text.count("<!-- plan"), len(COMMAND.findall(text)) + len(FIGURE.findall(text))
    assert marks == understood, (
        f"{page}: {marks - understood} of its '<!-- plan' marks are not in the form {__name__} reads"
    )
    for match in FIGURE.finditer(text):
        quoted, name, field = match.groups()
        assert name in commands, f"{page}: figure {quoted} names plan-command {name}, which the page does not define"
        assert field in FIELDS, f"{page}: figure {quoted} asks for field {field}; fields: {', '.join(FIELDS)}"
        printed = FIELDS[field](plan_json(commands[name]))
        line = text.count("\n", 0, match.start()) + 1
        yield line, quoted, printed, commands[name], field, match.span(1)


def test_the_quoted_max_seq_len_figures_are_what_the_planner_prints():
    wrong, marked = [], 0
    for page in PAGES:
        for line, quoted, printed, command, field, _ in quoted_figures(page):
            marked += 1
            if quoted != printed:
                wrong.append(
                    f"{page}:{line}: quotes {quoted} as {field} of `meshtron plan {command}`, which prints {printed}"
                )
    assert marked >= 8, f"only {marked} marked figures: were the marks lost?"
    assert not wrong, "\n".join(wrong + ["regenerate: PYTHONPATH=$PWD python tests/test_doc_figures.py --write"])


def write() -> None:
    """Replace every marked figure by what the planner prints."""
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        for line, quoted, printed, command, field, (start, end) in reversed(list(quoted_figures(page))):
            if quoted != printed:
                print(f"{page}:{line}: {field} {quoted} -> {printed}")
                text = text[:start] + printed + text[end:]
        path.write_text(text)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=$PWD python tests/test_doc_figures.py --write")
    write()
