"""What torchrun's environment says about this process: whether a launcher started it as one rank, the world size,
the processes on this machine. Read without importing torch: the command line asks before any command needs it.

torchrun (and ``meshtron train|eval --nproc``, which runs torch's elastic launcher) sets ``RANK`` and ``WORLD_SIZE``
for every worker; a process started by hand has neither.
"""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    """Whether a launcher (torchrun, or ``meshtron train|eval --nproc`` through it) started this process as one rank:
    the one place meshtron decides it (the commands, preflight, the process group and ``meshtron check`` ask here)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """World size given by torchrun's environment, 1 when started as a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size(default: int = 1) -> int:
    """Processes on this machine (torchrun's LOCAL_WORLD_SIZE), ``default`` outside torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))
