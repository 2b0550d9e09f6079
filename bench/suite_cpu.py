"""Where the test suite's CPU goes: runs `make test`'s pytest command with every Python process logging its CPU time
at exit, then prints the suite's time and CPU per test module (the processes each module started, with their
children) and the pytest workers' own in-process CPU.

    .venv/bin/python bench/suite_cpu.py                          # the whole suite, as `make test` runs it
    .venv/bin/python bench/suite_cpu.py tests/test_parity.py     # some modules (arguments go to pytest)

On the 2-core machine both pytest workers stay busy, so the suite's wall time is about its CPU time / 2: a change
that saves CPU in any process shortens it. Processes that end with ``os._exit`` (forked ranks) or are killed do not
log themselves; their CPU is in the parent that waited for them, or in the forkserver that forked them (counted
apart: no process waits for a forkserver), so every figure below is complete.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadscope", "--no-loadscope-reorder"]
# Written into a sitecustomize.py on PYTHONPATH: every interpreter started below imports it.
LOGGER = """import atexit, os, resource, sys

def _log_cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    forkserver = int("multiprocessing.forkserver import main" in " ".join(sys.orig_argv))
    fields = (os.getpid(), os.getppid(), own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime, test)
    fields += (forkserver,)
    with open(os.environ["SUITE_CPU_LOG"], "a") as log:
        log.write("\\t".join(map(str, fields)) + "\\n")

atexit.register(_log_cpu)
"""


def run(pytest_args: list[str], log: Path, hook_dir: Path) -> tuple[int, float]:
    (hook_dir / "sitecustomize.py").write_text(LOGGER)
    env = dict(os.environ, SUITE_CPU_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    code = subprocess.call([sys.executable, *PYTEST, *pytest_args], cwd=REPO, env=env)
    return code, time.perf_counter() - started


def report(log: Path, wall_s: float) -> None:
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    processes = {
        int(pid): (int(ppid), float(own), float(children), test, forkserver == "1")
        for pid, ppid, own, children, test, forkserver in rows
    }
    main = os.getpid()
    pytest_main = [pid for pid, (ppid, *_) in processes.items() if ppid == main]
    # A forkserver (multiprocessing's: meshtron's launcher starts one, so does meshtron check) is never waited for by
    # the process that started it, so its CPU and that of the workers it forked and reaped are in no parent's figure.
    forkservers = sum(own + children for _, own, children, _, forkserver in processes.values() if forkserver)
    total = sum(processes[pid][1] + processes[pid][2] for pid in pytest_main) + forkservers
    workers = {pid for pid, (ppid, *_) in processes.items() if ppid in pytest_main}
    by_module: collections.Counter = collections.Counter()
    for ppid, own, children, test, forkserver in processes.values():
        if ppid in workers or forkserver:
            by_module[test or "(no test)"] += own + children
    in_process = sum(processes[pid][1] for pid in workers)
    print(f"\npytest: {wall_s:.1f} s wall, {total:.0f} s CPU (user + sys, every process it started included)")
    print(f"{in_process:8.1f} s  the pytest workers' own (in-process) tests")
    for module, cpu in by_module.most_common():
        print(f"{cpu:8.1f} s  {module}'s processes")


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        log, hook_dir = Path(scratch) / "cpu.tsv", Path(scratch)
        code, wall_s = run(sys.argv[1:], log, hook_dir)
        report(log, wall_s)
    return code


if __name__ == "__main__":
    sys.exit(main())
