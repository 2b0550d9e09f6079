"""The settings reference, made from meshtron.config's dataclasses: docs/configuration.md's tables and the
``meshtron train --help`` list of settings.

Each row is a field of a section of ``Config``: its key, its dataclass default, its attribute docstring (the
string under it), the choices validation accepts (``CHOICES``; ``model.preset``: meshtron.models.presets, which
config.py, the lowest layer, cannot import), its other spellings (``KEY_ALIASES``) and environment variable
(``ENV_DEGREES``). So the page cannot drift from the code: edit the docstrings, then regenerate with
``python -m meshtron.settings_reference`` (tests/test_settings_reference.py fails until the page is regenerated).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from meshtron.config import (
    CHOICES,
    DEPRECATED_KEYS,
    ENV_DEGREES,
    KEY_ALIASES,
    RETIRED_KEYS,
    Config,
    _split_optional,
    field_types,
)
from meshtron.models.presets import ALIASES, PRESETS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m meshtron.settings_reference"
BEGIN = f"<!-- settings reference: generated from meshtron/config.py by `{REGENERATE}`; edit the docstrings there -->"
END = "<!-- end of settings reference -->"


@dataclass(frozen=True)
class Setting:
    key: str  # section.field
    default: Any
    doc: str  # the attribute docstring, cleaned
    choices: tuple[str, ...]  # what validation accepts; empty: any value of the type
    aliases: tuple[str, ...]
    env: str | None


def _docstrings(cls: type) -> tuple[str, dict[str, str]]:
    """A dataclass's own docstring and each field's attribute docstring (the string literal under it), from its
    source: Python keeps neither attribute docstrings nor, for a dataclass without one, its own."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    body = node.body
    fields = {}
    for item, after in zip(body, [*body[1:], None]):
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            string = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            fields[item.target.id] = inspect.cleandoc(string) if isinstance(string, str) else ""
    return inspect.cleandoc(ast.get_docstring(node) or ""), fields


def sections() -> dict[str, tuple[str, list[Setting]]]:
    """Section name -> (the section's docstring, its settings in field order)."""
    env_of = {f"parallel.{key}": var for var, key in ENV_DEGREES.items()}
    result = {}
    for section_field in dataclasses.fields(Config):
        cls: Any = section_field.default_factory  # each section of Config is a field defaulting to its class
        section_doc, docs = _docstrings(cls)
        types_ = field_types(cls)
        settings = []
        for f in dataclasses.fields(cls):
            key = f"{section_field.name}.{f.name}"
            if key == "optimizer.settings":  # a row per registered optimizer's own setting instead
                settings += optimizer_settings_rows()
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            settings.append(
                Setting(
                    key=key,
                    default=default,
                    doc=docs.get(f.name, ""),
                    choices=choices_of(key, types_[f.name]),
                    aliases=tuple(alias for alias, target in KEY_ALIASES.items() if target == key),
                    env=env_of.get(key),
                )
            )
        result[section_field.name] = (section_doc, settings)
    return result


def optimizer_settings_rows() -> list[Setting]:
    """``optimizer.<name>.<key>``: each registered optimizer's own settings (meshtron.train.optim.registry)."""
    rows = []
    from meshtron.train.optim.registry import OPTIMIZERS  # here: it imports torch, which `meshtron --help` never needs

    for name, entry in OPTIMIZERS.items():
        _, docs = _docstrings(entry.settings)
        for f in dataclasses.fields(entry.settings):
            key = f"optimizer.{name}.{f.name}"
            rows.append(Setting(key, f.default, f"``{name}``: {docs.get(f.name, '')}", (), (), None))
    return rows


def preset_choices() -> tuple[str, ...]:
    """``model.preset``'s values: every preset, in meshtron.models.presets' order, then the aliases."""
    return (*PRESETS, *ALIASES)


def choices_of(key: str, field_type: Any) -> tuple[str, ...]:
    """What validation accepts for ``key``: its ``CHOICES`` (and ``none`` when the setting is optional)."""
    if key == "model.preset":
        return preset_choices()
    if key == "optimizer.name":
        from meshtron.train.optim.registry import OPTIMIZERS

        return tuple(OPTIMIZERS)
    if key not in CHOICES:
        return ()
    return CHOICES[key] + (("none",) if _split_optional(field_type)[1] else ())


def _code(text: str) -> str:
    return f"`{text}`"


def format_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return _code(str(value).lower())
    if isinstance(value, float):
        return _code(re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value)).replace("e+", "e"))
    if isinstance(value, list):
        return _code(json.dumps(value))
    if value == "":
        return "empty"
    return _code(str(value))


def format_text(doc: str) -> str:
    """A docstring as one markdown line: ````x```` as code, ``docs/PAGE.md#anchor`` as a link to the page."""
    text = " ".join(doc.split())
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return re.sub(r"docs/([\w.-]+\.md)(#[\w-]+)?", lambda m: f"[{m[1]}]({m[1]}{m[2] or ''})", text)


def _choices_text(setting: Setting) -> str:
    if not setting.choices:
        return ""
    if setting.key == "model.preset":
        presets = ", ".join(_code(name) for name in PRESETS)
        aliases = ", ".join(f"{_code(alias)} ({_code(name)})" for alias, name in ALIASES.items())
        return f"Choices: {presets}; aliases {aliases}."
    what = "Each item one of" if isinstance(setting.default, list) else "Choices"
    return f"{what}: {', '.join(_code(choice) for choice in setting.choices)}."


def row(setting: Setting) -> str:
    extras = [_choices_text(setting)]
    if setting.aliases:
        extras.append(f"Also spelled {', '.join(_code(alias) for alias in setting.aliases)}.")
    if setting.env:
        extras.append(f"Environment variable: {_code(setting.env)}.")
    meaning = " ".join(part for part in [format_text(setting.doc), *extras] if part)
    cells = [_code(setting.key), format_default(setting.default), meaning]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def reference_markdown() -> str:
    """The page's generated part, markers included."""
    lines = [BEGIN, ""]
    for name, (doc, settings) in sections().items():
        lines += [f"### `[{name}]`", ""]
        if doc:
            lines += [format_text(doc), ""]
        lines += ["| key | default | meaning |", "| --- | --- | --- |", *map(row, settings), ""]
    retired = ", ".join(f"{_code(key)} (use {format_text(instead)})" for key, instead in RETIRED_KEYS.items())
    lines += [f"Retired settings, refused with a line naming the replacement: {retired}.", ""]
    moved = ", ".join(f"{_code(old)} -> {_code(new)}" for old, new in DEPRECATED_KEYS.items())
    lines += [
        "Deprecated keys (moved out of `[train]`): still accepted, in a config file, on the command line and in a "
        "saved run's or checkpoint's config.toml, with a one-line note naming the new key, until the next release; "
        "then an error. An old key and its new one in the same file or command line is an error. "
        f"The moves: {moved}.",
        "",
        END,
    ]
    return "\n".join(lines)


def render_page(page_text: str) -> str:
    """``page_text`` with its generated part replaced by the current one."""
    start, end = page_text.find(BEGIN), page_text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no '{BEGIN}' ... '{END}' markers")
    return page_text[:start] + reference_markdown() + page_text[end + len(END) :]


def help_epilog(width: int | None = None) -> str:
    """``meshtron train --help``'s list of settings: each section's keys, and where their meaning is."""
    width = width or max(40, min(100, shutil.get_terminal_size().columns - 2))
    header = (
        "settings: --section.key=VALUE, or key = VALUE under [section] in the --config file. Defaults, choices and "
        "meanings: docs/configuration.md; --print-config prints the resolved config as TOML."
    )
    lines = textwrap.wrap(header, width)
    for section in dataclasses.fields(Config):
        keys = " ".join(f.name for f in dataclasses.fields(cast(Any, section.default_factory)) if f.name != "settings")
        if section.name == "optimizer":
            from meshtron.train.optim.registry import OPTIMIZERS

            own = (f"{name}.{f.name}" for name, entry in OPTIMIZERS.items() for f in dataclasses.fields(entry.settings))
            keys += " " + " ".join(own)
        lines += textwrap.wrap(keys, width, initial_indent=f"  [{section.name}] ", subsequent_indent=" " * 6)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m meshtron.settings_reference [PAGE]``: rewrite the page's generated part (default: this
    checkout's docs/configuration.md)."""
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else PAGE
    text = path.read_text()
    new = render_page(text)
    if new != text:
        path.write_text(new)
    print(f"{path}: {'regenerated' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
