"""How a ``meshtron`` process ends: an error said in one line (``report_error``), and leaving without the
interpreter's teardown where torch.distributed would make it fail or take seconds (``leave``, ``exit_after``)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn

from meshtron.distributed.torchrun_env import launched_by_torchrun
from meshtron.errors import ConfigError, MeshtronError, note_reported_end

UNIFORM_ERROR_GRACE_S = 30.0
"""How long at most a rank other than 0 waits before leaving with an error that every rank has and only rank 0 prints:
torchrun stops all workers as soon as one exits with an error, which could stop rank 0 before its line is out. Rank 0
has the same error, so its exit ends the wait at once (the launcher stops the waiting ranks); the bound only matters
where nothing stops them. It was 2 s until a loaded CI machine started rank 0 more than 2 s after rank 1."""


def report_error(err: MeshtronError) -> int:
    """Print ``err`` as one line (rank 0 for an error every rank has, each rank its own otherwise) and return the exit
    status: 2 for a setting (``ConfigError``), 1 otherwise."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"meshtron: error: {err}", file=sys.stderr, flush=True)
    elif not err.uniform:
        print(f"meshtron: error [rank {rank}]: {err}", file=sys.stderr, flush=True)
    else:
        time.sleep(UNIFORM_ERROR_GRACE_S)
    return 2 if isinstance(err, ConfigError) else 1


def leave(code: int, reported: bool) -> NoReturn:
    """End this process now with ``code``, its output flushed, skipping the interpreter's teardown; ``reported``: it
    said why in its own line, which its launcher is told (``note_reported_end``)."""
    if reported:
        note_reported_end(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Run ``main`` (the ``meshtron`` command) and end the process with its exit status.

    A torchrun worker whose process group is destroyed leaves with ``os._exit``, skipping the interpreter's
    teardown: that destroys C++ objects of torch.distributed that can still own threads (gloo's, the rendezvous
    store's), and in CI it once aborted a rank of a restarted run after the run had finished ("terminate called
    without an active exception", exit -6), which torchrun counted as a failure of the whole run. Everything a
    run writes is closed by then; stdout, stderr and logging are flushed here.

    A ``--nproc`` launcher leaves the same way once its workers have ended: its teardown (about 2,000 modules) took
    seconds on a loaded machine, between a hung run's workers being stopped and the command returning.

    A Ctrl-C outside training (which saves and stops on it) ends with status 130 and no traceback.
    """
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130  # 128 + SIGINT, as a shell reports it
        if not launched_by_torchrun():  # a worker's launcher says what was saved
            print("meshtron: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    else:
        if launched_by_torchrun():
            note_reported_end(code)  # main returns an error's status after its line: no report from torch
    launched_workers = "torch.distributed.elastic.agent.server.api" in sys.modules
    if (launched_by_torchrun() or launched_workers) and "torch.distributed" in sys.modules:
        leave(code, reported=False)
    sys.exit(code)
