"""No test seams in production code (issue 58): the fault injection reaches training through the run's one fault
plan (meshtron.resilience.faults, built by the run's set-up), the hang watchdog's clock, I/O and exit are one
injectable object, and no helper exists only for tests."""

from __future__ import annotations

import inspect
from pathlib import Path

import meshtron.checkpoint.manager
import meshtron.resilience.watchdog
import meshtron.train.setup.preflight
import meshtron.train.step

FAULT_WORDS = ("resilience.faults", "MESHTRON_FAULT", "faults_from_env", "fault_plan", "faulted_loss", "visible_up_to")
"""What a module that reads or asks for a test fault names."""


def test_step_watchdog_checkpoints_and_preflight_name_no_fault():
    for module in (
        meshtron.train.step,
        meshtron.resilience.watchdog,
        meshtron.checkpoint.manager,
        meshtron.train.setup.preflight,
    ):
        source = Path(inspect.getsourcefile(module)).read_text()
        named = [word for word in FAULT_WORDS if word in source]
        assert not named, f"{module.__name__} names {named}: faults go through the run's fault plan"


def test_the_hang_watchdog_takes_its_clock_io_and_exit_as_one_object():
    from meshtron.resilience.watchdog import HangWatchdog

    parameters = set(inspect.signature(HangWatchdog).parameters)
    assert parameters == {"rank", "world_size", "timeout_s", "store", "stream_pending", "trace_dir", "io"}


def test_meshes_have_no_lookup_by_name_that_only_tests_used():
    from meshtron.distributed.mesh import Meshes

    assert not hasattr(Meshes, "get")
