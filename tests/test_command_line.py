"""What a new user meets on the command line: printed commands that run as printed, no known noise, and the test
launches' ports (tests/conftest.py) that two pytest workers cannot both take."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from conftest import PORTS_PER_WORKER, _port_range

from meshtron.command import meshtron_command


def test_meshtron_command_is_plain_only_where_path_finds_this_installation(tmp_path):
    script = Path(sys.executable).parent / "meshtron"
    assert script.is_file()  # the venv's console script (pip install -e .)
    assert meshtron_command(path_env=str(script.parent)) == "meshtron"
    # Not on PATH (a venv not activated), or PATH finds another installation: this one's script, as a path.
    elsewhere = tmp_path / "bin"
    elsewhere.mkdir()
    (elsewhere / "meshtron").write_text("#!/bin/sh\nexit 3\n")
    (elsewhere / "meshtron").chmod(0o755)
    for path_env in ("/usr/bin:/bin", str(elsewhere)):
        spelled = meshtron_command(cwd="/", path_env=path_env)
        assert spelled == str(script.absolute()), spelled
    below = meshtron_command(cwd=script.parent.parent.parent, path_env="")  # the repository root over .venv/bin
    assert below == os.path.join(script.parent.parent.name, "bin", "meshtron")


def test_known_third_party_noise_is_dropped_and_nothing_else():
    from meshtron.known_noise import KnownNoise

    noise = KnownNoise()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, message, None, None)

    torchao = (
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
        "release."
    )
    assert not noise.filter(record(torchao))
    assert noise.filter(record("register_constant() got an unexpected type"))


def test_each_pytest_worker_launches_on_ports_of_its_own(monkeypatch):
    """Disjoint ranges per worker, none in the kernel's ephemeral range (where a socket bound to port 0 can be
    handed the port between our choosing it and torchrun binding it) nor on torch's default port."""
    ranges = []
    for worker in ("gw0", "gw1", "gw2", "gw3"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        ranges.append(set(_port_range()))
    assert all(len(ports) == PORTS_PER_WORKER for ports in ranges)
    assert len(set().union(*ranges)) == 4 * PORTS_PER_WORKER
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    first_ephemeral = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    assert max(set().union(*ranges)) < first_ephemeral and 29500 not in set().union(*ranges)


def test_the_command_line_imports_no_torch_until_a_command_needs_it():
    """``meshtron --help``, ``meshtron data ...`` and the argument parsing of every command import neither torch nor
    transformers (seconds of CPU and ~250 MB that `meshtron data prepare`'s memory bound has no room for)."""
    import subprocess

    probe = (
        "import sys, meshtron.cli; meshtron.cli.build_parser(); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


FAKE_CUDA_FORKSERVER = """
import multiprocessing, os, sys
import torch

# A CUDA build on a GPU machine, faked: initializing CUDA is recorded, and the capability query initializes it as
# torch's does; NVML (no CUDA context) answers for device 0.
torch.version.cuda = "12.8"
torch.cuda.is_available = lambda: True
torch.cuda._lazy_init = lambda: setattr(torch.cuda, "_initialized", True)


def properties(device=None):
    torch.cuda._lazy_init()
    return type("Properties", (), {"major": 9, "minor": 0})()


torch.cuda.get_device_properties = properties
import meshtron.train.setup.rank_imports as rank_imports

rank_imports.capability_from_nvml = lambda index: (9, 0)
rank_imports.import_rank_modules()  # transformers -> torchao, which asks the capability at import time
print("after the preload imports: initialized", torch.cuda._initialized, flush=True)

from meshtron.launch import rank_start_for, run_forked_rank

fork = multiprocessing.get_context("fork")  # forks this process, as the forkserver forks itself
print("clean:", rank_start_for("forkserver", "cuda", fork), flush=True)
torch.cuda._initialized = True  # as an import that initialized CUDA anyway would leave it
print("initialized, cpu run:", rank_start_for("forkserver", "cpu", fork), flush=True)
print("initialized, gpu run:", rank_start_for("forkserver", "cuda", fork), flush=True)
os.environ["RANK"] = "0"
rank = fork.Process(target=run_forked_rank, args=(["train", "--model.preset=tiny"], "cuda"))
rank.start()
rank.join()
print("a rank forked anyway exits", rank.exitcode, flush=True)
"""


def test_forked_gpu_ranks_start_with_cuda_uninitialized_or_fresh(tmp_path):
    """torchao (which transformers imports when it is installed) asks the device's capability at import time, which
    initializes CUDA in the process the ranks are forked from: no rank could use CUDA. The preload imports leave a
    faked CUDA uninitialized (the question answered by NVML); where something initializes it anyway, a GPU run starts
    fresh workers with one line, and a rank forked anyway leaves with one line instead of CUDA's traceback."""
    import subprocess

    from conftest import worker_env

    script = tmp_path / "fake_cuda_forkserver.py"
    script.write_text(FAKE_CUDA_FORKSERVER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=worker_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "after the preload imports: initialized False",
        "clean: forkserver",
        "initialized, cpu run: forkserver",
        "initialized, gpu run: fresh",
        "a rank forked anyway exits 1",
    ], proc.stdout + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("meshtron:")]
    assert lines == [
        "meshtron: CUDA was initialized in the forkserver while it imported the ranks' modules (a child forked from "
        "it could not use CUDA): starting each worker fresh instead (--rank-start fresh)",
        "meshtron: error: CUDA was initialized in the forkserver before this rank was forked, so the rank cannot use "
        "it; run with --rank-start fresh",
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_forkservers_probe_names_what_touched_cuda_while_the_rank_modules_were_imported(monkeypatch, capfd):
    """meshtron check's forkserver had initialized CUDA on an H200 with torchao installed, and the launcher could only
    say so: the probe child now names the first call that initialized CUDA or poisoned forks during the imports, and
    the frames that made it."""
    import multiprocessing

    import torch

    from meshtron.train.setup import rank_imports

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(rank_imports, "CUDA_TOUCHES", [])

    def a_module_asking_the_device():
        torch.cuda._lazy_init()

    with rank_imports.noting_cuda_touches():
        a_module_asking_the_device()
        a_module_asking_the_device()
    torch.cuda._lazy_init()  # after the imports: not theirs
    assert len(rank_imports.CUDA_TOUCHES) == 1, rank_imports.CUDA_TOUCHES
    assert rank_imports.CUDA_TOUCHES[0].startswith("torch.cuda._lazy_init() from tests/test_command_line.py:")
    monkeypatch.setattr(rank_imports, "cuda_initialized_here", lambda: True)
    assert rank_imports.initialized_cuda_before_forking(multiprocessing.get_context("fork"))
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("meshtron:")]
    assert said == [f"meshtron: the forkserver's CUDA was touched by {rank_imports.CUDA_TOUCHES[0]}"], said


def test_a_worker_error_said_in_one_line_leaves_out_torchs_report_and_a_crash_keeps_it():
    """A worker that reported its own end (note_reported_end) is not followed by torch's lines about its failure and
    the other workers' stop; a worker that crashed (no note) still is."""
    from meshtron.errors import note_reported_end
    from meshtron.launch import AGENT_PROCESSES_LOGGER, reported_errors_kept

    agent, spawn = logging.getLogger(AGENT_PROCESSES_LOGGER), logging.getLogger("torch.multiprocessing.spawn")

    def shown(logger, message, *args) -> bool:
        return bool(logger.filter(logging.LogRecord(logger.name, logging.ERROR, __file__, 1, message, args, None)))

    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)"
    with reported_errors_kept():
        assert shown(spawn, "Terminating process %s via signal SIGTERM", 11)  # nothing reported yet
        note_reported_end(2)  # as a worker with this pid would
        assert not shown(spawn, "Terminating process %s via signal SIGTERM", 11)
        assert not shown(agent, failed, 2, 0, os.getpid(), "run_forked_rank", "forkserver")
        assert shown(agent, failed, -9, 1, os.getpid() + 1, "run_forked_rank", "forkserver")  # a crash, next attempt
        assert shown(agent, "Sending process %s closing signal %s", 11, "SIGTERM")
    assert "MESHTRON_REPORTED_ERRORS" not in os.environ
    assert shown(agent, failed, 2, 0, os.getpid(), "run_forked_rank", "forkserver")


def test_the_capability_comes_from_nvml_with_visible_devices_mapped(monkeypatch):
    """capability_from_nvml with a stand-in for libnvidia-ml (never run on a GPU): CUDA device 0 is the first of
    CUDA_VISIBLE_DEVICES, NVML is shut down after the question, and a failing or missing NVML answers None."""
    import ctypes

    import torch  # before ctypes.CDLL is replaced: torch loads its own libraries with it

    from meshtron.train.setup.rank_imports import capability_from_nvml

    assert torch.cuda.is_initialized() is False
    calls = []

    class FakeNvml:
        def __init__(self, fail_on=None):
            self.fail_on = fail_on

        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                if name == "nvmlDeviceGetHandleByIndex_v2":
                    calls.append(args[0])
                if name == "nvmlDeviceGetCudaComputeCapability":
                    args[1]._obj.value, args[2]._obj.value = 9, 0
                return 1 if name == self.fail_on else 0

            return call

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    monkeypatch.setattr(ctypes, "CDLL", lambda path: FakeNvml())
    assert capability_from_nvml(0) == (9, 0)
    assert calls == [
        "nvmlInit_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        3,
        "nvmlDeviceGetCudaComputeCapability",
        "nvmlShutdown",
    ]
    monkeypatch.setattr(ctypes, "CDLL", lambda path: FakeNvml(fail_on="nvmlDeviceGetCudaComputeCapability"))
    assert capability_from_nvml(0) is None and calls[-1] == "nvmlShutdown"

    def missing(path):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert capability_from_nvml(0) is None
