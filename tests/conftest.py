"""Shared helpers: launching torchrun workers and running the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The suite means CPU and gloo everywhere, also on a machine with GPUs: hide them from this process
# (before torch initializes CUDA) and from every process it starts.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One intra-op thread here, as in every rank it starts: the models are tiny, and `make test` runs two pytest workers
# beside multi-process launches on a 2-core machine, where a second OpenMP thread spins waiting for a core (measured:
# the in-process reference runs took 153 s instead of 12 s, the suite's CPU time grew by a quarter).
os.environ["OMP_NUM_THREADS"] = "1"

# `make test` runs two pytest workers (pytest-xdist, --dist loadscope: a module's tests, and so its module-scoped
# launches, stay on one worker). Modules whose launches take minutes go first, so that neither worker is left with
# one of them at the end; the rest keep their order.
LONGEST_FIRST = ("test_parity.py", "test_checkpoint.py", "test_recovery.py")


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a module, and of the other modules, is kept


def pytest_sessionstart(session) -> None:
    """In each process that runs tests: import what nearly every test module imports (torch, transformers, the
    training loop), then move every object made so far into the generation the garbage collector never scans
    (``gc.freeze``, as tests/parity_worker.py does before forking). Full collections of this process, and of the
    ranks it forks, then skip those ~330K objects instead of walking them again and again (five modules, 192 tests,
    in one process, three back-to-back pairs on a machine whose speed varies: 138 -> 113 s, 153 -> 127 s,
    147 -> 135 s). The xdist controller runs no test and imports nothing."""
    import gc

    if session.config.getoption("numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import meshtron.train.trainer  # noqa: F401

    gc.freeze()


PORTS_PER_WORKER = 2000
"""Rendezvous ports each pytest worker (and the processes it starts) hands out: disjoint ranges per worker."""


def _port_range() -> range:
    """This pytest worker's ports: below the kernel's ephemeral range (Linux: 32768 and up), so that no socket bound
    to port 0 (gloo's connections, torchrun --standalone, another test's listener) is ever handed one, away from
    torch's default 29500, and disjoint from the other workers' ranges. Before, a port picked by binding port 0 went
    back to the ephemeral pool until torchrun bound it, and the other worker's launch took it in between (EADDRINUSE
    at setup of a whole module's tests)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    start = 20_000 + PORTS_PER_WORKER * (index % 4)
    return range(start, start + PORTS_PER_WORKER)


def _port_candidates():
    """Every port of this worker's range once, starting at a place of this process's own (the worker and the
    launcher processes it starts draw from the same range, never at the same time)."""
    import random

    ports = _port_range()
    first = random.Random(os.getpid()).randrange(len(ports))
    while True:
        for offset in range(len(ports)):
            yield ports[(first + offset) % len(ports)]


_PORTS = _port_candidates()


def free_port() -> int:
    """A port for a launch's rendezvous (torchrun --master-port, MASTER_PORT, tcp:// init) that is free now and that
    no other pytest worker will take: the next of this worker's range (``_port_range``) that can be bound."""
    for _ in range(PORTS_PER_WORKER):
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT after an earlier launch
                continue
            return port
    raise RuntimeError(f"no free port in {_port_range()}")


def worker_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    for var in ("DP_SIZE", "TP_SIZE", "CP_SIZE", "PP_SIZE", "EP_SIZE"):  # meshtron.config.ENV_DEGREES
        env.pop(var, None)
    env.update(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES=""
    )
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that crashes (SIGABRT, SIGSEGV) prints its threads' Python stacks
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_torchrun(nproc: int, args: list[str], *, timeout: float = 600, cwd: Path | None = None, env=None):
    """Run ``torchrun --nproc-per-node nproc ARGS`` on this machine; returns the CompletedProcess."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=cwd or REPO, env=env or worker_env(), capture_output=True, text=True, timeout=timeout
    )


def run_forked(nproc: int, args: list[str], *, timeout: float = 600):
    """Run worker script ``args[0]`` (with ``args[1:]``) on ``nproc`` processes forked by tests/fork_launch.py after
    one import of torch and transformers, as ``run_torchrun`` would on fresh ones; returns the CompletedProcess."""
    cmd = [sys.executable, str(REPO / "tests" / "fork_launch.py"), str(nproc), *args]
    return subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)


def run_layouts(
    world: int | dict[str, int], base: list[str], layouts: dict[str, list[str]], out: Path, *, timeout: float = 900
):
    """Train ``layouts`` (name -> overrides on top of ``base``) in order, each on ``world`` processes (or
    ``world[name]``) forked by tests/parity_worker.py, which says when consecutive layouts share them (results in
    ``out``); fails the test with every rank's first errors if a layout fails. Returns the CompletedProcess, whose
    stdout has each layout's time."""
    worlds = world if isinstance(world, dict) else dict.fromkeys(layouts, world)
    spec = out / f"spec-{len(list(out.glob('spec*.json')))}.json"
    spec.write_text(json.dumps({"base": base, "layouts": layouts, "worlds": worlds}))
    cmd = [sys.executable, str(REPO / "tests" / "parity_worker.py"), str(spec), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, failure_report(proc)
    return proc


def failure_report(proc, tail: int = 4000) -> str:
    """The first error lines of every rank (a crashed rank's traceback is often far above the tail)
    and the end of the output, for an assertion message."""
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if "Error" in line and "Connection closed by peer" not in line]
    return "first errors:\n" + "\n".join(errors[:20]) + "\n...\n" + text[-tail:]


def run_main(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``meshtron ARGS`` in this process (``meshtron.cli.main``), its output captured: for commands that start
    no process group, without a new interpreter's imports (~6 s of CPU each)."""
    import contextlib
    import io

    from meshtron.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return subprocess.CompletedProcess(["meshtron", *args], code, out.getvalue(), err.getvalue())


def run_cli(args: list[str], *, timeout: float = 300, cwd: Path | None = None, env=None):
    """Run ``python -m meshtron ARGS`` in a fresh process."""
    cmd = [sys.executable, "-m", "meshtron", *args]
    return subprocess.run(
        cmd, cwd=cwd or REPO, env=env or worker_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenized-data cache shared by every test of the session."""
    return tmp_path_factory.mktemp("meshtron-cache")


def reference_attention(q, k, v, visible, scale):
    """Float64 softmax attention over the visible keys, key/value heads repeated for GQA."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def flip_a_byte(file, at: int | None = None) -> None:
    """Change one byte of ``file`` in place (its size stays the same): at ``at``, or in the middle."""
    data = bytearray(file.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0xFF
    file.write_bytes(bytes(data))


def two_step_run(model_setting: str, tmp_path: Path, cache_dir: Path, *extra: str):
    """The config of a one-process, two-step run of 2 sequences of 16 tokens that checkpoints at step 2 (under
    ``tmp_path / "run"``): ``model_setting`` is ``model.preset=...`` or ``model.name_or_path=...``."""
    from meshtron.config import load_config

    settings = [
        model_setting,
        "data.seq_len=16",
        "data.max_documents=20",
        f"data.cache_dir={cache_dir}",
        "train.steps=2",
        "train.global_batch_size=2",
        "checkpoint.interval=2",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        *extra,
    ]
    return load_config(None, settings, env={})


def train_llama_tiny(cache_dir: Path, out: Path, *extra: str, steps: int = 2):
    """llama-tiny trained in this process on CPU, 4 sequences of 64 tokens a step, with ``extra`` settings; the
    run's ``TrainResult`` (losses, gradient norms, the bytes autograd kept and offloaded)."""
    import torch

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    settings = [
        "model.preset=llama-tiny",
        "data.seq_len=64",
        "data.max_documents=40",
        f"data.cache_dir={cache_dir}",
        f"train.steps={steps}",
        "train.global_batch_size=4",
        "run.progress=false",
        f"run.output_dir={out}",
        *extra,
    ]
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    return train(load_config(None, settings, env={}), runtime)


def each_document_alone(model, tokens, eos: int):
    """The logits of every document of ``tokens`` (B, L; documents end at ``eos``) run alone through ``model``,
    concatenated back in place: what packed documents with document masks must equal."""
    import torch

    rows = []
    for row in tokens:
        ends = (row == eos).nonzero().flatten().tolist()
        starts = [0] + [e + 1 for e in ends]
        pieces = [row[s:e][None] for s, e in zip(starts, [e + 1 for e in ends] + [len(row)]) if e > s]
        rows.append(torch.cat([model(input_ids=p).logits for p in pieces], dim=1))
    return torch.cat(rows)


def full_blocks(block_mask):
    """(B, Q blocks, KV blocks) bool of the blocks the kernel runs without calling the mask_mod."""
    import itertools

    import torch

    full = torch.zeros(block_mask.kv_indices.shape, dtype=torch.bool)
    for b, h, q in itertools.product(*map(range, block_mask.full_kv_num_blocks.shape)):
        count = int(block_mask.full_kv_num_blocks[b, h, q])
        full[b, h, q, block_mask.full_kv_indices[b, h, q, :count].long()] = True
    return full[:, 0]


def assert_same_tensors(checkpoint: Path, reference: Path, scratch: Path) -> None:
    """Every tensor of two DCP checkpoints is equal (bit for bit)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch / "got.pt")
    dcp_to_torch_save(reference, scratch / "want.pt")
    got, want = (torch.load(scratch / f"{name}.pt", weights_only=False) for name in ("got", "want"))
    flat_got, flat_want = _tensors(got), _tensors(want)
    assert flat_got.keys() == flat_want.keys() and len(flat_got) > 10
    assert all(torch.equal(flat_got[key], flat_want[key]) for key in flat_want)


def _tensors(tree, prefix: str = "") -> dict:
    """Every tensor of a nested state dict by its dotted path."""
    import torch

    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _tensors(value, f"{prefix}.{key}").items()}
    return {}
