"""Shared by the multi-process benchmarks: run this same script as a torchrun worker and read its result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_workers(script: str, nproc: int, run_dir: Path, extra_args: list[str] = (), log: Path | None = None) -> dict:
    """Run ``script --worker --run-dir RUN_DIR <this command's arguments> <extra_args>`` under torchrun with
    ``nproc`` processes (one thread each) and return the ``result.json`` that rank 0 wrote into ``run_dir``.

    ``log``: write the workers' output there instead of the console."""
    command = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--nnodes",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            script,
            "--worker",
            "--run-dir",
            str(run_dir),
        ]
        + [a for a in sys.argv[1:] if a != "--worker"]
        + list(extra_args)
    )
    repo = str(Path(script).resolve().parent.parent)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    if log is None:
        subprocess.run(command, env=env, check=True)
    else:
        with open(log, "w") as out:
            completed = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        if completed.returncode:
            raise RuntimeError(f"workers failed (exit {completed.returncode}); their output is in {log}")
    return json.loads((run_dir / "result.json").read_text())
