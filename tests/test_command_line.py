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
    from meshtron.cli import _KnownNoise

    noise = _KnownNoise()

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
        "import sys, meshtron.cli; meshtron.cli._parser(); print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
