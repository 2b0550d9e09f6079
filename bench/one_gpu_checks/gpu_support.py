"""What the one-GPU checks share: skipping without a GPU, short in-process runs and rehearsals, meshtron's command,
and comparisons that fail with a message naming the figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


FIGURES: dict = {}
"""What this check's process has measured so far: written with its result when it fails too (``record``,
``expect_ratio``, ``expect_close``)."""


def record(**figures) -> dict:
    """Add ``figures`` to what this check reports, pass or fail; all of them so far."""
    FIGURES.update(figures)
    return FIGURES


class Skip(Exception):
    """A check that cannot run here (no GPU, a missing package); its message is the reason."""


ON_CPU = os.environ.get("GPU_QUEUE_ON_CPU") == "1"
"""``GPU_QUEUE_ON_CPU=1``: run the CUDA checks on the CPU, to try their logic without a GPU (their figures and some
of their bounds mean nothing there)."""


def cuda_device():
    """The GPU the checks run on; ``Skip`` without one."""
    import torch

    if ON_CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", 0)


def device_setting() -> str:
    """``run.device`` of the checks' runs."""
    return "run.device=cpu" if ON_CPU else "run.device=cuda"


def exact_float32(torch) -> None:
    """fp32 matmuls without TF32, as ``meshtron check`` compares the GPU with the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def settings_for(out: Path, *extra: str, preset: str = "llama-tiny", seq_len: int = 64, batch: int = 4, steps: int = 3):
    """meshtron settings of a short run on the embedded data, ``extra`` last (it overrides)."""
    return [
        f"model.preset={preset}",
        f"data.seq_len={seq_len}",
        "data.max_documents=40",
        f"train.steps={steps}",
        f"train.global_batch_size={batch}",
        "run.progress=false",
        f"run.output_dir={out}",
        *extra,
    ]


def train_here(device, settings: list[str]):
    """``settings`` trained in this process on ``device`` (one rank, no process group); the ``TrainResult``."""
    import torch

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device(device))
    return train(load_config(None, settings, env={}), runtime)


def rehearse_here(settings: list[str], world_size: int = 1, rank: int = 0, steps: int = 4):
    """``meshtron train --rehearse --nproc world_size --rank rank`` in this process: (report, losses of its
    metrics.jsonl). In a world of one the fake collectives are exact, so the losses are real."""
    from meshtron.config import load_config
    from meshtron.plan.rehearsal import rehearse

    report = rehearse(load_config(None, settings, env={}), world_size, rank, steps)
    return report, [row["loss"] for row in metrics_rows(Path(report.output_dir))]


def metrics_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def meshtron(*args: str, env: dict | None = None) -> str:
    """``python -m meshtron ARGS`` from the repository root; its output (stdout and stderr), also passed on line by
    line to this check's log as it comes (a check the queue kills leaves there how far the command got). A non-zero
    exit fails the check with the output's last lines."""
    print(f"$ meshtron {' '.join(args)}", flush=True)
    lines = []
    with subprocess.Popen(
        [sys.executable, "-m", "meshtron", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    ) as child:
        for line in child.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    output = "".join(lines)
    if child.returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-6:])
        raise AssertionError(f"meshtron {' '.join(args[:2])} ... exited {child.returncode}: {tail}")
    return output


def worst_relative(got: list[float], want: list[float]) -> float:
    """The largest |got - want| / |want| over paired values (inf when a value is not finite or lengths differ)."""
    if len(got) != len(want) or not got:
        return math.inf
    worst = 0.0
    for a, b in zip(got, want):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def expect_close(name: str, got: list[float], want: list[float], rel: float) -> float:
    """Fail unless ``got`` is within ``rel`` of ``want`` value by value; the worst relative difference."""
    worst = worst_relative(got, want)
    record(**{f"{name.replace(' ', '_')}_rel_diff": worst})
    assert worst <= rel, f"{name}: {got} vs {want}, worst relative difference {worst:.2e} > {rel:.0e}"
    return worst


def expect_ratio(name: str, measured: float, planned: float, low: float, high: float) -> float:
    """Fail unless measured / planned lies in [low, high]; the ratio."""
    assert planned, f"{name}: nothing planned (measured {measured:,.0f})"
    ratio = measured / planned
    record(**{f"{name.replace(' ', '_')}_measured_over_planned": round(ratio, 4)})
    assert low <= ratio <= high, (
        f"{name}: measured {measured:,.0f} / planned {planned:,.0f} = x{ratio:.3f}, outside [x{low}, x{high}]"
    )
    return round(ratio, 4)


def pinned_stats() -> dict:
    """torch's pinned host allocator statistics (``torch.cuda.host_memory_stats``), or {} where this torch has
    none."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    return dict(stats()) if stats is not None and torch.cuda.is_available() else {}


def relative_error(got, want) -> float:
    """max |got - want| / max |want|, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
