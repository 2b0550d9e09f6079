"""Checkpoint save and load time, and how long a save stalls training, sync vs async (CPU, one process).

Trains ``--steps`` steps saving every ``--interval`` steps, once with ``checkpoint.async=false`` and
once with ``true``, timing inside meshtron's ``CheckpointManager``:

* stall per save: the time training waits in ``save()``: sync, the whole write and commit; async,
  finishing the previous background save, staging the state and starting the next write;
* the final wait: at the end of an async run, for the last background save to commit;
* load time: ``load()`` of the last checkpoint in a resumed run (model + optimizer, DCP).

Example:

    python bench/checkpoint.py                      # llama-mini, 12 steps, save every 3
    python bench/checkpoint.py --preset llama-small --steps 20 --interval 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

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
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="meshtron-ckpt-bench-"))
    common = [f"train.steps={args.steps}", f"checkpoint.interval={args.interval}"]
    results = {}
    for mode in ("sync", "async"):
        results[mode] = run(
            args, workdir, mode, common + [f"checkpoint.async={'true' if mode == 'async' else 'false'}"]
        )
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
    print("| mode | saves | stall per save ms (median) | run wall s |")
    print("|---|---:|---:|---:|")
    for mode, r in results.items():
        saves = r["calls"]["save"]  # save() includes waiting for the previous async save
        print(f"| {mode} | {len(saves)} | {statistics.median(saves) * 1e3:.1f} | {r['wall_s']:.2f} |")
    print(f"load (model + optimizer): {loaded['calls']['load'][0] * 1e3:.1f} ms")
    print(
        "final wait for the last async save at the end of the run: "
        f"{results['async']['calls']['wait'][-1] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
