"""The one error type users see: a clear, one-line message naming the setting and the fix."""

import contextlib
import importlib
import os
from pathlib import Path
from types import ModuleType

REPORTED_ERRORS_ENV = "MESHTRON_REPORTED_ERRORS"
"""Set by ``meshtron train|eval --nproc`` (meshtron.launch) for its workers: a folder where a worker that said in its
own line why it ends leaves a file named by its pid, so that the launcher leaves torch's report of that end out."""


class MeshtronError(Exception):
    """A user-facing error. ``str(err)`` is a single line that names the setting and the fix.

    ``uniform`` is True when every rank is known to raise the same error (for example a
    config check run identically everywhere); then only rank 0 prints it.
    """

    def __init__(self, message: str, *, uniform: bool = True):
        super().__init__(" ".join(message.split()))
        self.uniform = uniform


class ConfigError(MeshtronError):
    """A bad setting in the config file, the CLI overrides or the environment."""


def note_reported_end(code: int) -> None:
    """In a worker that ends with status ``code`` after saying why in its own line: tell its launcher (nothing under
    a launcher other than meshtron's, or for status 0)."""
    directory = os.environ.get(REPORTED_ERRORS_ENV)
    if code and directory:
        with contextlib.suppress(OSError):
            Path(directory, str(os.getpid())).touch()


def import_extra(module: str, *, needed_by: str, extra: str) -> ModuleType:
    """``module`` imported, or a one-line ConfigError saying that ``needed_by`` (a setting or a command) needs it and
    which meshtron extra installs it (``pip install 'meshtron[extra]'``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        package = module.split(".")[0]
        if err.name is None or err.name.split(".")[0] != package:
            raise  # the package is there but something it imports is broken: torch's own message says what
        raise ConfigError(
            f"{needed_by} needs the {package} package, which meshtron installs only on request: "
            f"pip install 'meshtron[{extra}]' (or pip install {package})"
        ) from None
