"""Whether a checkpoint on disk is whole: the manifest a save records and the check a resume runs.

When a save commits, rank 0 lists every file of the checkpoint with its size in ``meshtron.json``
(``files``). Before a run resumes, every rank (in preflight, before any collective) compares the folder
with that list: a missing file or one of another size (a truncated write, a copy cut short, a disk that
filled up after the commit) marks the checkpoint damaged. ``checkpoint.resume=auto`` then falls back to the
newest complete checkpoint that is whole and says which one it skipped; an explicit path is an error.

Sizes catch what interrupted writes and copies leave; they do not catch bytes changed in place, which
surface when torch.distributed.checkpoint reads the tensors (an error naming the checkpoint).
Checkpoints written before the manifest existed are checked for their metadata files only.
"""

from __future__ import annotations

import json
from pathlib import Path

META = "meshtron.json"
FILES = "files"


def file_manifest(directory: Path, skip: tuple[str, ...] = (META,)) -> dict[str, int]:
    """{relative path: size in bytes} of every file under ``directory`` (``skip``: names left out)."""
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name not in skip
    }


def damage(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be loaded as it is, in a few words, or None when it is whole."""
    path = Path(path)
    if not path.is_dir():
        return "the folder does not exist"
    if not (path / ".metadata").is_file():
        return "no .metadata (torch.distributed.checkpoint's index)"
    if not (path / META).is_file():
        return f"no {META}"
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"{META} is unreadable ({str(err).splitlines()[0]})"
    for name, size in sorted(meta.get(FILES, {}).items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        found = file.stat().st_size
        if found != size:
            return f"{name} has {found:,} bytes, {size:,} when saved"
    return None
