"""The launcher's side of a stop by signal, for ``meshtron train --nproc`` (torchrun's agent runs in-process).

torchrun's agent forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the workers and then waits 30 s before it
kills them. For a stop with a checkpoint (meshtron.resilience.preemption) the launcher asks it to forward SIGUSR1
as well and to wait as long as the workers may take to finish a step and save (``run.collective_timeout_s``
plus a margin), and it ignores a repeated signal: otherwise the agent's handler would raise again in the
middle of its shutdown and leave, with the workers still saving. Under a torchrun of one's own, pass
``--signals-to-handle`` and ``--shutdown-timeout`` (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from types import SimpleNamespace

from meshtron.resilience.preemption import EXIT_PREEMPTED, LAUNCHER_SIGNALS
from meshtron.resilience.watchdog import COLLECTIVE_GRACE_S


@contextlib.contextmanager
def forward_stop_signals(parser, launcher_args: list[str], timeout_s: float):
    """Add the signal options torchrun's ``parser`` knows to ``launcher_args``; yields ``.exception`` (the agent's
    exception for a signal) and ``.received`` (the first signal, or None)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing import api as agent_api

    known = parser._option_string_actions
    if "--signals-to-handle" in known:
        launcher_args.append(f"--signals-to-handle={LAUNCHER_SIGNALS}")
    if "--shutdown-timeout" in known:
        launcher_args.append(f"--shutdown-timeout={int(timeout_s + COLLECTIVE_GRACE_S)}")
    state = SimpleNamespace(exception=SignalException, received=None)
    forward = getattr(agent_api, "_terminate_process_handler", None)

    def first_only(signum, frame):
        if state.received is not None:
            return  # already stopping: the workers are finishing their step and saving
        state.received = signum
        forward(signum, frame)

    if forward is not None:  # looked up by name when the agent installs its handlers
        agent_api._terminate_process_handler = first_only
    try:
        yield state
    finally:
        if forward is not None:
            agent_api._terminate_process_handler = forward


def stopped_with_checkpoint(cfg, started: float, received: int) -> int:
    """The launcher's exit status after a signal: ``EXIT_PREEMPTED`` when the workers saved a checkpoint of
    their stop after ``started`` (a time), else 128 + the signal number, as a shell reports a killed process."""
    from meshtron.checkpoint.manager import LATEST, checkpoint_directory

    directory = checkpoint_directory(cfg)
    try:
        newest = Path(directory) / (Path(directory) / LATEST).read_text().strip()
        meta = json.loads((newest / "meshtron.json").read_text())
        if meta.get("stopped_by") and newest.stat().st_mtime >= started - 1:
            return EXIT_PREEMPTED
    except (OSError, ValueError, TypeError):
        pass
    return 128 + int(received or signal.SIGTERM)
