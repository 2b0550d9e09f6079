"""Checkpoint save and load time, and how long a save stalls training, sync vs async (CPU, one process);
what the checksums of a save cost.

Trains ``--steps`` steps saving every ``--interval`` steps, with ``checkpoint.async=false`` and ``true``, each
with the per-file checksums (meshtron.checkpoint.integrity) and without them (patched out here), timing inside
meshtron's ``CheckpointManager``:

* stall per save: the time training waits in ``save()``: sync, the whole write and commit; async,
  finishing the previous background save, staging the state and starting the next write;
* the final wait: at the end of an async run, for the last background save to commit;
* load time: ``load()`` of the last checkpoint in a resumed run (model + optimizer, DCP);
* checksums: zlib.crc32 MB/s over a ``--checksum-mb`` file (page cache warm) and the resume-time check of the last
  checkpoint (``content_damage``, one process reading every file).

Example:

    python bench/checkpoint.py                      # llama-mini, 12 steps, save every 3
    python bench/checkpoint.py --preset llama-small --steps 20 --interval 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshtron.checkpoint import integrity, manager
from meshtron.checkpoint.manager import CheckpointManager
from meshtron.config import load_config
from meshtron.distributed.runtime import Runtime
from meshtron.train.trainer import train


class Timed:
    """Record the duration of CheckpointManager's save / wait / load calls (bench-only instrumentation)."""

    def __init__(self):
        self.calls: dict[str, list[float]] = {"save": [], "wait": [], "load": []}
        self.originals = {name: getattr(CheckpointManager, name) for name in self.calls}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(CheckpointManager, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(CheckpointManager, name, original)

    def _wrap(self, name, original):
        def timed(manager, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(manager, *args, **kwargs)
            finally:
                self.calls[name].append(time.perf_counter() - started)

        return timed


@contextlib.contextmanager
def without_checksums():
    """Saves as before checksums existed: no rank checksums its files, meshtron.json records none (bench only)."""
    originals = manager.rank_checksums, manager.manifest_checksums
    manager.rank_checksums = lambda *args: {}
    manager.manifest_checksums = lambda *args: {}
    try:
        yield
    finally:
        manager.rank_checksums, manager.manifest_checksums = originals


@contextlib.contextmanager
def timed_checksums(seconds: list[float]):
    """Append the seconds each save spends checksumming (a rank's own files, then rank 0's at the commit)."""
    originals = manager.rank_checksums, manager.manifest_checksums

    def timed(function):
        def run(*args):
            started = time.perf_counter()
            try:
                return function(*args)
            finally:
                seconds.append(time.perf_counter() - started)

        return run

    manager.rank_checksums, manager.manifest_checksums = (timed(function) for function in originals)
    try:
        yield
    finally:
        manager.rank_checksums, manager.manifest_checksums = originals


def checksum_rate(workdir: Path, megabytes: int) -> float:
    """MB/s of integrity.file_checksum over a new ``megabytes`` file, read once before (page cache warm)."""
    path = workdir / "checksum-probe.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as stream:
        for _ in range(megabytes):
            stream.write(block)
    integrity.file_checksum(path)
    started = time.perf_counter()
    integrity.file_checksum(path)
    rate = path.stat().st_size / 1e6 / (time.perf_counter() - started)
    path.unlink()
    return rate


def run(args, workdir: Path, name: str, extra: list[str]) -> dict:
    overrides = (
        [
            f"model.preset={args.preset}",
            f"data.max_documents={args.documents}",
            f"data.seq_len={args.seq_len}",
            f"train.global_batch_size={args.batch}",
            "run.progress=false",
            f"run.output_dir={workdir / name}",
            f"checkpoint.dir={workdir / 'checkpoints' / name}",
        ]
        + extra
        + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
    )
    cfg = load_config(None, overrides, env={})
    with Timed() as timed:
        started = time.perf_counter()
        result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
        wall = time.perf_counter() - started
    state_mb = sum(result.state_bytes.values()) / 1e6
    return {"wall_s": wall, "calls": timed.calls, "state_mb": state_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-mini")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--cache-dir")
    parser.add_argument("--checksum-mb", type=int, default=1024, help="size of the file checksummed for MB/s")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-ckpt-bench-"))
    common = [f"train.steps={args.steps}", f"checkpoint.interval={args.interval}"]
    results = {}
    for mode in ("sync", "async"):
        for checked in (True, False):
            name = mode if checked else f"{mode}, no checksums"
            checksum_s: list[float] = []
            with timed_checksums(checksum_s) if checked else without_checksums():
                results[name] = run(
                    args, workdir, name, common + [f"checkpoint.async={'true' if mode == 'async' else 'false'}"]
                )
            results[name]["checksum_ms"] = [sum(pair) * 1e3 for pair in zip(checksum_s[::2], checksum_s[1::2])]
    loaded = run(
        args,
        workdir,
        "resume",
        [
            f"train.steps={args.steps}",
            "checkpoint.interval=0",
            f"checkpoint.resume={workdir / 'checkpoints' / 'sync' / f'step-{args.steps:08d}'}",
        ],
    )
    print(
        f"model {args.preset}: parameters + gradients + AdamW state {results['sync']['state_mb']:.1f} MB; "
        f"{args.steps} steps, a save every {args.interval}"
    )
    print("| mode | saves | stall per save ms (median) | checksums per save ms (median) | run wall s |")
    print("|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        saves = r["calls"]["save"]  # save() includes waiting for the previous async save
        checksums = f"{statistics.median(r['checksum_ms']):.1f}" if r["checksum_ms"] else "-"
        print(f"| {mode} | {len(saves)} | {statistics.median(saves) * 1e3:.1f} | {checksums} | {r['wall_s']:.2f} |")
    print(f"load (model + optimizer): {loaded['calls']['load'][0] * 1e3:.1f} ms")
    for mode in ("async", "async, no checksums"):
        waited_ms = results[mode]["calls"]["wait"][-1] * 1e3
        print(f"final wait for the last save at the end of the run ({mode}): {waited_ms:.1f} ms")
    last = workdir / "checkpoints" / "sync" / f"step-{args.steps:08d}"
    size_mb = sum(integrity.file_manifest(last).values()) / 1e6
    started = time.perf_counter()
    reason = integrity.content_damage(last, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    checked_ms = (time.perf_counter() - started) * 1e3
    print(f"resume-time check of the last checkpoint ({size_mb:.1f} MB, one process): {checked_ms:.1f} ms ({reason})")
    rate = checksum_rate(workdir, args.checksum_mb)
    print(f"zlib.crc32 over a {args.checksum_mb} MB file (page cache warm): {rate:,.0f} MB/s")


if __name__ == "__main__":
    main()
