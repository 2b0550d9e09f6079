"""``meshtron check``: train a tiny model under every layout N ranks can host and compare each with one process.

Runs one after another, each on fresh processes forked from a forkserver (multiprocessing's): a process started
once, before any of them, that imports torch, transformers and meshtron's training loop once
(meshtron.check.preload), so that a run's ranks start without ~5 s of imports each. Fresh processes per run
rather than one launch for all: layouts that shared processes kept their process groups' threads, and torch's
caches keyed by device mesh would hand a destroyed group to the next layout (tests/parity_worker.py says more).
A forkserver rather than forks of this process: this process may initialize CUDA (device names, versions), after
which a forked child cannot use it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from pathlib import Path

from meshtron.check.compare import CPU, CUDA, compare
from meshtron.check.layouts import DEFAULT_STEPS, CheckCase, Run, base_overrides, layouts_for, write_pairs
from meshtron.check.report import COLUMNS, LEGEND, Row, environment_lines, verdict
from meshtron.check.worker import BREAK_ENV, COLLECTIVE_TIMEOUT_S, run_rank
from meshtron.distributed.torchrun_env import launched_by_torchrun
from meshtron.errors import ConfigError
from meshtron.train.setup.rank_imports import initialized_cuda_before_forking

RUN_TIMEOUT_S = 600.0
"""A run that has not finished by then counts as hung: its ranks are killed and its row says so."""
DEFAULT_CPU_NPROC = 2


def resolve_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA GPU is visible; use --device cpu")
    return device


def resolve_nproc(nproc: int | None, device: str) -> int:
    """``--nproc``, or every visible GPU, or 2 on CPU; at most one process per GPU."""
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if nproc is None:
        return gpus if device == "cuda" else DEFAULT_CPU_NPROC
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if device == "cuda" and nproc > gpus:
        raise ConfigError(f"--nproc {nproc} but {gpus} GPU(s) visible (one per process); use --nproc {gpus}")
    return nproc


def select(layouts: list[CheckCase], only: str | None) -> list[CheckCase]:
    """The layouts ``--only a,b`` names (all without it); an unknown name is an error listing the known ones."""
    if not only:
        return layouts
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = [layout.name for layout in layouts]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"--only: no layout {', '.join(unknown)} on this many processes; known: {', '.join(known)}")
    return [layout for layout in layouts if layout.name in names]


def _rendezvous_store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _threads(world: int) -> int:
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // world)


class _Launcher:
    """Starts a run's ranks from the forkserver and waits for them; keeps each run's results by its key."""

    def __init__(self, out: Path, base: list[str], broken: str | None, timeout_s: float):
        self.out, self.base, self.broken, self.timeout_s = out, base, broken, timeout_s
        self.context: BaseContext = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["meshtron.check.preload"])
        self.cuda_checked = False
        self.done: dict[str, tuple[list[dict] | None, str | None, float]] = {}

    def context_for(self, device: str):
        """The context that starts a run's ranks: the forkserver's, or fresh interpreters (spawn) for GPU runs when
        CUDA was initialized in the forkserver anyway (no child forked from it could use CUDA), said in one line."""
        if device == "cuda" and not self.cuda_checked:
            self.cuda_checked = True
            if initialized_cuda_before_forking(self.context):
                print(
                    "meshtron check: CUDA was initialized in the forkserver while it imported the ranks' modules: "
                    "each GPU rank starts as a fresh interpreter instead",
                    file=sys.stderr,
                    flush=True,
                )
                self.context = multiprocessing.get_context("spawn")
        return self.context

    def run(self, run: Run, layout_name: str) -> tuple[list[dict] | None, str | None, float]:
        """(each rank's results or None, why not, seconds)."""
        if run.key not in self.done:
            started = time.perf_counter()
            error = self._launch(run, broken=self.broken == layout_name)
            ranks = None if error else self._results(run)
            self.done[run.key] = (ranks, error, time.perf_counter() - started)
        return self.done[run.key]

    def _launch(self, run: Run, broken: bool) -> str | None:
        directory = self.out / run.key
        directory.mkdir(parents=True)
        overrides = [
            *self.base,
            f"model.preset={run.model}",
            f"run.device={run.device}",
            f"run.output_dir={directory / 'run'}",
            f"run.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
            *run.overrides,
        ]
        if run.pairs:
            overrides.append(f"data.path={write_pairs(directory / 'pairs.jsonl')}")
        # The ranks' rendezvous store is served from here, bound at once to a port the OS picks (no port is chosen
        # first and bound later, which another process could take in between); the ranks join it as clients, as
        # torchrun's workers join their agent's store.
        store = _rendezvous_store() if run.world > 1 else None
        port = store.port if store else 0
        env = dict(os.environ)
        job = dict(
            world=run.world,
            port=port,
            overrides=overrides,
            device=run.device,
            out=str(directory),
            env=env,
            threads=_threads(run.world),
            broken=broken,
        )
        context = self.context_for(run.device)
        ranks = [context.Process(target=run_rank, args=({**job, "rank": rank},)) for rank in range(run.world)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + self.timeout_s
        running = list(ranks)
        while running:
            wait([process.sentinel for process in running], timeout=max(0.0, deadline - time.monotonic()))
            running = [process for process in ranks if process.exitcode is None]
            failed = [rank for rank, process in enumerate(ranks) if process.exitcode not in (None, 0)]
            timed_out = bool(running) and time.monotonic() > deadline
            if failed or timed_out:
                for process in running:
                    process.kill()
                for process in ranks:
                    process.join()
                if timed_out and not failed:
                    return f"timed out after {self.timeout_s:.0f} s"
                return f"rank {failed[0]} failed (exit code {ranks[failed[0]].exitcode}): {_first_error(directory)}"
        return None

    def _results(self, run: Run) -> list[dict]:
        import torch

        return [torch.load(self.out / run.key / f"rank{rank}.pt", weights_only=True) for rank in range(run.world)]


def _first_error(directory: Path) -> str:
    """The last line of the first rank log that holds a traceback: the exception, in one line."""
    for log in sorted(directory.glob("rank*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            lines = [line for line in text.splitlines() if line.strip()]
            return lines[-1][:200] if lines else ""
    return "no traceback (killed?)"


def run_check(
    nproc: int | None = None,
    *,
    only: str | None = None,
    steps: int = DEFAULT_STEPS,
    device: str = "auto",
    timeout_s: float = RUN_TIMEOUT_S,
    out=None,
) -> int:
    """Run the check and print it (to ``out``, default stdout); 0 when every layout matches one process, 1
    otherwise."""
    out = out or sys.stdout
    if launched_by_torchrun():
        raise ConfigError("meshtron check starts its own processes; run it without torchrun")
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    device = resolve_device(device)
    nproc = resolve_nproc(nproc, device)
    layouts = select(layouts_for(nproc, device), only)
    tolerance = CUDA if device == "cuda" else CPU
    started = time.perf_counter()

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    say(f"meshtron check: {len(layouts)} layouts on {nproc} process(es), {steps} steps each against one process")
    for line in environment_lines(device, nproc):
        say(f"  {line}")
    directory = Path(tempfile.mkdtemp(prefix="meshtron-check-"))
    launcher = _Launcher(
        directory, base_overrides(nproc, steps, str(directory / "cache")), os.environ.get(BREAK_ENV), timeout_s
    )
    say()
    say(COLUMNS)
    rows = []
    for layout in layouts:
        reference, ref_error, _ = launcher.run(layout.reference, layout.reference.key)
        ranks, error, seconds = launcher.run(layout.run, layout.name)
        row = Row(layout.name, layout.run.world, seconds, what=layout.what)
        if ref_error:
            row.error = f"the one-process reference failed: {ref_error}"
        elif error:
            row.error = error
        else:
            row.comparison = compare(ranks, reference[0], tolerance)
        rows.append(row)
        say(row.line())
    say(LEGEND)
    passed = all(row.passed for row in rows)
    if passed:
        shutil.rmtree(directory, ignore_errors=True)
    for line in verdict(rows, device, None if passed else str(directory)):
        say(line)
    say(f"({time.perf_counter() - started:.0f} s in all)")
    return 0 if passed else 1
