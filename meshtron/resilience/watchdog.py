"""Hang detection: every rank stops, naming the rank(s) that did not arrive, instead of waiting forever.

A background thread on each rank watches the training loop's progress marks (the start of a step, the end
of a save). When ``run.collective_timeout_s`` passes without one, it looks at where its main thread is:
inside torch.distributed or a host sync of the step (waiting for the other ranks), or elsewhere (busy: a
stuck data loader, a deadlock in user code). Each rank writes that to the rendezvous store and waits a few
seconds for the others' reports; a rank that sends none is gone (a dead host, a process stuck holding the
GIL). The lowest waiting rank prints one line naming the step and the ranks that did not arrive, a busy
rank prints where it is, and every rank exits with ``EXIT_HUNG``, so torchrun ends (or restarts) the group.
It does not depend on the backend's own timeouts, so it works alike for gloo and NCCL; the process group's
collective timeout is set ``COLLECTIVE_GRACE_S`` later so that this line comes first.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

EXIT_HUNG = 124
"""Exit status of a rank that gave up waiting (as ``timeout`` uses)."""
COLLECTIVE_GRACE_S = 60.0
REPORT_WAIT_S = 10.0
STORE_GRACE_S = 5.0
"""Beyond the report wait, how long a store operation may take before a rank that is giving up stops waiting."""
# Functions in which a main thread waits for the other ranks: host syncs of the step (on GPUs the host waits
# there, not inside torch.distributed).
WAITING_FUNCTIONS = {"host_values", "synchronize", "barrier"}


def main_thread_location() -> tuple[bool, str]:
    """(waiting for other ranks, where) of the main thread, ``where`` as ``file.py:line in function``."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "unknown"
    stack = traceback.extract_stack(frame)
    waiting = any(
        "torch/distributed" in entry.filename.replace(os.sep, "/") or entry.name in WAITING_FUNCTIONS for entry in stack
    )
    stdlib = sysconfig.get_paths()["stdlib"]
    ours = [
        entry for entry in stack if "torch" not in Path(entry.filename).parts and not entry.filename.startswith(stdlib)
    ] or list(stack)
    last = ours[-1]
    return waiting, f"{Path(last.filename).name}:{last.lineno} in {last.name}"


class HangWatchdog:
    """Stops this process (``EXIT_HUNG``) when no progress mark comes for ``timeout_s`` seconds.

    ``store`` (a torch.distributed Store shared by the ranks, with keys of this attempt) is where the ranks
    tell each other where they are; ``locate``, ``exit`` and ``stream`` are for tests.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store,
        *,
        poll_s: float = 1.0,
        report_wait_s: float = REPORT_WAIT_S,
        locate=main_thread_location,
        exit=os._exit,
        stream=None,
    ):
        self.locate = locate
        self.rank, self.world_size, self.timeout_s, self.store = rank, world_size, timeout_s, store
        self.poll_s, self.report_wait_s, self.exit, self.stream = poll_s, report_wait_s, exit, stream or sys.stderr
        self.step, self.phase, self.last = 0, "start-up", time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtron-hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self.last = time.monotonic()
        self._thread.start()
        return self

    def progress(self, step: int, phase: str = "step") -> None:
        """A progress mark: this rank is at ``step`` (1-based) doing ``phase``."""
        self.step, self.phase, self.last = step, phase, time.monotonic()

    def close(self) -> None:
        """Stop watching; the thread is gone when this returns (or, if it was already giving up, the process)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # Not a few polls: on a loaded machine the woken thread may wait that long for a core. Giving up takes
            # at most two bounded store waits (``_in_time``) before it ends the process.
            self._thread.join(timeout=self.poll_s + 2 * self._store_wait_s + STORE_GRACE_S)

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            idle = time.monotonic() - self.last
            if idle >= self.timeout_s:
                self.give_up(idle)
                return

    def give_up(self, idle: float) -> None:
        """Tell the others where this rank is, learn where they are, print one line and exit."""
        step, phase = self.step, self.phase
        waiting, where = self.locate()
        reports: dict[int, dict] = {}
        self._in_time(lambda: self._exchange(step, waiting, where, reports))
        missing = [r for r in range(self.world_size) if r not in reports and r != self.rank]
        busy = {r: report["where"] for r, report in sorted(reports.items()) if not report["waiting"]}
        if not waiting:
            busy[self.rank] = where
        absent = sorted([*busy, *missing])
        waiting_ranks = [r for r, report in reports.items() if report["waiting"]]
        announced = f"step-{step}/announced"
        if self.rank != min(waiting_ranks or reports or [self.rank]):  # one rank says it for all: let it first
            self._in_time(lambda: self._wait_for(announced))
        else:
            who = ", ".join(map(str, absent)) if absent else "none (every rank waits: mismatched collectives?)"
            details = "; ".join(
                [
                    *(f"rank {r} busy at {w}" for r, w in busy.items()),
                    *(f"rank {r} sent no report (dead or stuck)" for r in missing),
                ]
            )
            print(
                f"meshtron: error [rank {self.rank}]: step {step}{'' if phase == 'step' else f' ({phase})'} made no "
                f"progress for {idle:.0f} s "
                f"(run.collective_timeout_s={self.timeout_s:g}): rank(s) {who} did not arrive"
                + (f" ({details})" if details else "")
                + f"; every rank exits with status {EXIT_HUNG}",
                file=self.stream,
                flush=True,
            )
            self._in_time(lambda: self.store.set(announced, "1"))
        self.exit(EXIT_HUNG)

    def _in_time(self, action) -> None:
        """Run a store operation, giving up after the report wait (a store on a dead host must not hold us)."""

        def run():
            try:
                action()
            except Exception:  # noqa: BLE001 - an unreachable store: nothing more to learn or tell
                pass

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(self._store_wait_s)

    @property
    def _store_wait_s(self) -> float:
        """The longest one store operation of ``give_up`` may hold it (``_in_time``)."""
        return self.report_wait_s + STORE_GRACE_S

    def _wait_for(self, key: str) -> None:
        deadline = time.monotonic() + self.report_wait_s
        while not self.store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _exchange(self, step: int, waiting: bool, where: str, reports: dict) -> None:
        """Write this rank's report, then collect the others' (those not heard from are named as missing)."""
        self.store.set(f"step-{step}/rank-{self.rank}", json.dumps({"waiting": waiting, "where": where}))
        reports[self.rank] = {"waiting": waiting, "where": where}
        keys = {r: f"step-{step}/rank-{r}" for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + self.report_wait_s
        while keys and time.monotonic() < deadline:
            for r, key in list(keys.items()):
                if self.store.check([key]):
                    reports[r] = json.loads(self.store.get(key))
                    del keys[r]
            time.sleep(0.2)


def start_watchdog(runtime, timeout_s: float) -> HangWatchdog | None:
    """A running watchdog for this rank of a multi-process run (None in a single process)."""
    if not runtime.distributed:
        return None
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    from meshtron.resilience.restart import restart_count

    store = PrefixStore(f"meshtron/hang/attempt-{restart_count()}/", _get_default_store())
    return HangWatchdog(runtime.rank, runtime.world_size, timeout_s, store).start()
