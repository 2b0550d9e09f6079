"""The launcher's side of a stop by signal, for ``meshtron train --nproc`` (torchrun's agent runs in-process).

torchrun's agent forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the workers and then waits 30 s before it
kills them. For a stop with a checkpoint (meshtron.resilience.preemption) the launcher asks it to forward SIGUSR1
as well and to wait as long as the workers may take to finish a step and save (``run.collective_timeout_s``
plus a margin), and it ignores a repeated SIGTERM / SIGHUP / SIGQUIT / SIGUSR1: otherwise the agent's handler would
raise again in the middle of its shutdown and leave, with the workers still saving. A SIGINT while stopping (a second
Ctrl-C) ends the workers at once (``interrupt``). Under a torchrun of one's
own, pass ``--signals-to-handle`` and ``--shutdown-timeout`` (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

from meshtron.resilience.preemption import EXIT_PREEMPTED, LAUNCHER_SIGNALS
from meshtron.resilience.watchdog import COLLECTIVE_GRACE_S


@contextlib.contextmanager
def forward_stop_signals(parser, launcher_args: list[str], timeout_s: float):
    """Add the signal options torchrun's ``parser`` knows to ``launcher_args``; yields ``.exception`` (the agent's
    exception for a signal), ``.received`` (the first signal, or None) and ``.at_once`` (whether a SIGINT came
    while stopping)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing import api as agent_api

    known = parser._option_string_actions
    if "--signals-to-handle" in known:
        launcher_args.append(f"--signals-to-handle={LAUNCHER_SIGNALS}")
    if "--shutdown-timeout" in known:
        launcher_args.append(f"--shutdown-timeout={int(timeout_s + COLLECTIVE_GRACE_S)}")
    state = SimpleNamespace(exception=SignalException, received=None, at_once=False, workers=None)
    forward = getattr(agent_api, "_terminate_process_handler", None)
    start_processes = getattr(local_elastic_agent, "start_processes", None)

    def first_only(signum, frame):
        if state.received is None:
            state.received = signum
            forward(signum, frame)
        elif signum == signal.SIGINT:
            state.at_once = True
            interrupt(state.workers)
        # else already stopping: the workers are finishing their step and saving

    def keep_workers(*args, **kwargs):
        state.workers = start_processes(*args, **kwargs)
        return state.workers

    # both looked up by name: the handler when the agent installs its handlers, start_processes at each start
    if forward is not None:
        agent_api._terminate_process_handler = first_only
    if start_processes is not None:
        local_elastic_agent.start_processes = keep_workers
    quiet = _ForwardedSignalLines(state)
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield state
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        state.workers = None  # its queues' semaphores are released with it (else "leaked semaphore objects")
        if forward is not None:
            agent_api._terminate_process_handler = forward
        if start_processes is not None:
            local_elastic_agent.start_processes = start_processes


AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")
FORWARDING_LINES = ("Received %s death signal", "Closing process %s via signal", "Sending process %s closing signal")
"""The beginnings of the agent's lines saying that it sends a signal it received on to the workers (forked ones, fresh
ones)."""


class _ForwardedSignalLines(logging.Filter):
    """Drops the agent's lines about sending on a stop signal (the workers' own line says what the stop did); a
    worker that does not stop is still reported ("Unable to shutdown process")."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        return self.state.received is None or not str(record.msg).startswith(FORWARDING_LINES)


def interrupt(workers) -> None:
    """End each process of ``workers`` (torch's PContext, or None: nothing started yet) at once: SIGKILL, to the
    process group a fresh worker leads. Not SIGINT: a rank blocked in C (a CUDA sync, an NCCL wait, a write) runs
    its Python handler once however many SIGINTs came meanwhile, so a quick second Ctrl-C would count as its first
    there, and that rank would go on to save alone and wait out the collective timeout."""
    try:
        pids = workers.pids() if workers is not None else {}
    except AssertionError:  # torch's context of processes that have ended
        pids = {}
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def stopped_with_checkpoint(directory: Path | None, started: float, received: int) -> int:
    """The launcher's exit status after a signal: ``EXIT_PREEMPTED`` when the workers saved a checkpoint of
    their stop after ``started`` (a time) in ``directory`` (the run's checkpoints), else 128 + the signal number, as a
    shell reports a killed process."""
    from meshtron.checkpoint.manager import LATEST

    try:
        newest = Path(directory) / (Path(directory) / LATEST).read_text().strip()
        meta = json.loads((newest / "meshtron.json").read_text())
        if meta.get("stopped_by") and newest.stat().st_mtime >= started - 1:
            return EXIT_PREEMPTED
    except (OSError, ValueError, TypeError):
        pass
    return 128 + int(received or signal.SIGTERM)
