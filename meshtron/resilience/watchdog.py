"""Hang detection: every rank stops, naming the rank(s) that did not arrive, instead of waiting forever.

A background thread on each rank watches the training loop's progress marks (the start of a step, the end
of a save). When ``run.collective_timeout_s`` passes without one, it looks at where its main thread is:
inside torch.distributed or a host sync of the step (waiting for the other ranks), or elsewhere (busy: a
stuck data loader, a deadlock in user code). On GPUs a rank whose device stream still has work queued counts
as waiting wherever its host is: NCCL calls return at once and the host blocks at the next sync (``.item()``,
``.tolist()``) behind the collective that cannot finish. Each rank writes that to the rendezvous store and waits a few
seconds for the others' reports; a rank that sends none is gone (a dead host, a process stuck holding the
GIL). The lowest waiting rank prints one line naming the step and the ranks that did not arrive, a busy
rank prints where it is, and every rank exits with ``EXIT_HUNG``, so torchrun ends (or restarts) the group.
Under NCCL each rank first writes NCCL's flight recorder (its last collectives of every process group and
their state) to ``<run.output_dir>/flight-recorder-step-<N>/nccl_trace_rank_<R>``, the folder that the line
names and torch's ``torchfrtrace`` reads; ``enable_flight_recorder`` turns the recorder on before the process
group exists.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from meshtron.errors import note_reported_end

if TYPE_CHECKING:
    from meshtron.distributed.runtime import Runtime

EXIT_HUNG = 124
"""Exit status of a rank that gave up waiting (as ``timeout`` uses)."""
COLLECTIVE_GRACE_S = 60.0
REPORT_WAIT_S = 10.0
STORE_GRACE_S = 5.0
"""Beyond the report wait, how long a store operation may take before a rank that is giving up stops waiting."""
# Functions in which a main thread waits for the other ranks: host syncs of the step (on GPUs the host waits
# there, not inside torch.distributed).
WAITING_FUNCTIONS = {"host_values", "synchronize", "barrier"}
TRACE_PREFIX = "nccl_trace_rank_"
"""A flight recorder file's name before its rank (torch's own, TORCH_NCCL_DEBUG_INFO_TEMP_FILE's default)."""
FLIGHT_RECORDER_ENTRIES = 20000
"""Collectives NCCL's flight recorder keeps per rank when the user did not choose (as torchtitan's default)."""
FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's settings of the recorder's size (the first from torch 2.10; the second read by both 2.11 and 2.13)."""


def enable_flight_recorder(environ=os.environ) -> None:
    """Turn NCCL's flight recorder on for this process (call before the process group is created), unless the
    user set its size (0 turns it off)."""
    if not any(environ.get(name) for name in FLIGHT_RECORDER_VARIABLES):
        environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def flight_recorder_trace() -> bytes | None:
    """NCCL's flight recorder of this rank, pickled, or None without an NCCL process group (or a torch without
    ``_dump_nccl_trace``, present in 2.11 and 2.13 CUDA builds)."""
    import torch
    import torch.distributed as dist

    dump = getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
    if dump is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if "nccl" not in str(dist.get_backend()):
        return None
    return dump(includeCollectives=True, includeStackTraces=True, onlyActive=False)


def device_stream_pending(device) -> Callable[[], bool]:
    """Whether ``device``'s stream of the calling (main) thread still has work queued or running; always False
    off CUDA. Call in the main thread: the watchdog thread asks the stream it returns."""
    if device is None or device.type != "cuda":
        return lambda: False
    import torch

    stream = torch.cuda.current_stream(device)

    def pending() -> bool:
        try:
            return not stream.query()
        except Exception:  # noqa: BLE001 - a device in an error state: nothing to learn from it
            return False

    return pending


def main_thread_location() -> tuple[bool, str]:
    """(waiting for other ranks, where) of the main thread, ``where`` as ``file.py:line in function``."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "unknown"
    stack = traceback.extract_stack(frame)
    waiting = any(_waits_for_ranks(entry) for entry in stack)
    stdlib = sysconfig.get_paths()["stdlib"]
    ours = [
        entry for entry in stack if "torch" not in Path(entry.filename).parts and not entry.filename.startswith(stdlib)
    ] or list(stack)
    last = ours[-1]
    return waiting, f"{Path(last.filename).name}:{last.lineno} in {last.name}"


def _waits_for_ranks(entry: traceback.FrameSummary) -> bool:
    """Whether a frame of the main thread waits for other ranks: in torch.distributed (a collective, the store), but
    not in torch's elastic launcher, whose frames are at the bottom of every worker forked by ``meshtron train
    --nproc``, or in a host sync of the step."""
    path = entry.filename.replace(os.sep, "/")
    return ("torch/distributed" in path and "torch/distributed/elastic" not in path) or entry.name in WAITING_FUNCTIONS


@dataclass(frozen=True)
class WatchdogIO:
    """How a HangWatchdog watches, looks and leaves: its clock, where it looks and what it writes, how it exits.
    The defaults are a run's; tests give shorter waits, a fixed location, a list for the exit status."""

    poll_s: float = 1.0
    """How often the watching thread looks at the progress marks."""
    report_wait_s: float = REPORT_WAIT_S
    """How long a rank that gives up waits for the others' reports."""
    locate: Callable[[], tuple[bool, str]] = main_thread_location
    """(waiting for other ranks, where) of this rank's main thread."""
    exit: Callable[[int], object] = os._exit
    stream: TextIO | None = None
    """Where the line goes (None: ``sys.stderr`` when the watchdog is made)."""
    dump_trace: Callable[[], bytes | None] = flight_recorder_trace
    """This rank's NCCL flight recorder."""


class HangWatchdog:
    """Stops this process (``EXIT_HUNG``) when no progress mark comes for ``timeout_s`` seconds.

    ``store`` (a torch.distributed Store shared by the ranks, with keys of this attempt) is where the ranks
    tell each other where they are; ``stream_pending`` (``device_stream_pending``) whether this rank's device
    still works on what the host queued; ``trace_dir`` where the flight recorder goes when giving up; ``io`` its
    clock, I/O and exit (WatchdogIO).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store,
        *,
        stream_pending: Callable[[], bool] = lambda: False,
        trace_dir: Path | None = None,
        io: WatchdogIO = WatchdogIO(),
    ):
        self.stream_pending, self.trace_dir, self.io = stream_pending, trace_dir, io
        self.rank, self.world_size, self.timeout_s, self.store = rank, world_size, timeout_s, store
        self.stream = io.stream or sys.stderr
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
            self._thread.join(timeout=self.io.poll_s + 2 * self._store_wait_s + STORE_GRACE_S)

    def _watch(self) -> None:
        while not self._stopped.wait(self.io.poll_s):
            idle = time.monotonic() - self.last
            if idle >= self.timeout_s:
                self.give_up(idle)
                return

    def give_up(self, idle: float) -> None:
        """Tell the others where this rank is, learn where they are, print one line and exit."""
        step, phase = self.step, self.phase
        waiting, where = self.io.locate()
        if not waiting and self.stream_pending():  # the host runs ahead; its device waits for a collective
            waiting, where = True, f"{where} (its device stream still has work queued)"
        traces = self._write_trace(step)
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
                + (
                    f"; NCCL flight recorder of each rank in {traces} (read it with: torchfrtrace {traces})"
                    if traces
                    else ""
                )
                + f"; every rank exits with status {EXIT_HUNG}",
                file=self.stream,
                flush=True,
            )
            self._in_time(lambda: self.store.set(announced, "1"))
        note_reported_end(EXIT_HUNG)  # the line above says it for every rank
        self.io.exit(EXIT_HUNG)

    def _write_trace(self, step: int) -> Path | None:
        """Write this rank's flight recorder into ``trace_dir``; the folder of every rank's, or None when this
        rank has none (named as torch names them: ``torchfrtrace FOLDER`` reads them)."""
        if self.trace_dir is None:
            return None
        path = Path(self.trace_dir) / f"flight-recorder-step-{step}" / f"{TRACE_PREFIX}{self.rank}"

        def write() -> None:
            path.unlink(missing_ok=True)  # an earlier attempt's, hung at the same step
            trace = self.io.dump_trace()
            if trace:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(trace)

        self._in_time(write)
        return path.parent if path.is_file() else None

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
        return self.io.report_wait_s + STORE_GRACE_S

    def _wait_for(self, key: str) -> None:
        deadline = time.monotonic() + self.io.report_wait_s
        while not self.store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _exchange(self, step: int, waiting: bool, where: str, reports: dict) -> None:
        """Write this rank's report, then collect the others' (those not heard from are named as missing)."""
        self.store.set(f"step-{step}/rank-{self.rank}", json.dumps({"waiting": waiting, "where": where}))
        reports[self.rank] = {"waiting": waiting, "where": where}
        keys = {r: f"step-{step}/rank-{r}" for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + self.io.report_wait_s
        while keys and time.monotonic() < deadline:
            for r, key in list(keys.items()):
                if self.store.check([key]):
                    reports[r] = json.loads(self.store.get(key))
                    del keys[r]
            time.sleep(0.2)


def start_watchdog(runtime: Runtime, timeout_s: float, trace_dir: Path | None = None) -> HangWatchdog | None:
    """A running watchdog for this rank of a multi-process run (None in a single process); ``trace_dir``: where
    the flight recorder goes (the run's output directory). Call in the main thread."""
    if not runtime.distributed:
        return None
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    from meshtron.resilience.restart import restart_count

    store = PrefixStore(f"meshtron/hang/attempt-{restart_count()}/", _get_default_store())
    return HangWatchdog(
        runtime.rank,
        runtime.world_size,
        timeout_s,
        store,
        stream_pending=device_stream_pending(runtime.device),
        trace_dir=trace_dir,
    ).start()
