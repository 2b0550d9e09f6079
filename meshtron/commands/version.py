"""``meshtron --version``: meshtron's, torch's and transformers' versions."""

from __future__ import annotations


def version_line() -> str:
    """``meshtron 0.1.0 (torch X, transformers Y)``, read from the installed packages' metadata (no imports)."""
    from importlib.metadata import PackageNotFoundError, version

    from meshtron import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"meshtron {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"
