"""How to spell the ``meshtron`` command in a line printed for the user, so that it runs as printed.

After ``make demo`` the command lives in ``.venv/bin``, which is not on PATH until the venv is activated; a printed
``meshtron plot ...`` would then end in "command not found". ``meshtron_command()`` says ``meshtron`` when PATH
finds this very installation, and otherwise the path of this installation's script (relative to the working
directory when it lies below it), or ``python -m meshtron`` with this interpreter.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def meshtron_command(cwd: str | os.PathLike | None = None, path_env: str | None = None) -> str:
    """The command that starts this installation of meshtron from ``cwd`` (default: the working directory) with
    ``path_env`` as PATH (default: the environment's), quoted for a POSIX shell."""
    script = Path(sys.executable).parent / "meshtron"
    if script.is_file():
        found = shutil.which("meshtron", path=os.environ.get("PATH", "") if path_env is None else path_env)
        if found is not None and Path(found).resolve() == script.resolve():
            return "meshtron"
        here, shown = Path(cwd or os.getcwd()).resolve(), script.absolute()
        if here != Path(here.anchor) and shown.is_relative_to(here):  # e.g. .venv/bin/meshtron from the repository
            shown = shown.relative_to(here)
        return shlex.quote(str(shown))
    return f"{shlex.quote(sys.executable)} -m meshtron"
