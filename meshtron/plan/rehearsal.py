"""``meshtron train --rehearse``: train one rank of a big layout in one process, at that rank's real shapes.

The process joins a fake process group as rank R of N (``meshtron.distributed.one_rank_group``: collectives
return at once and move no data; each gives what this rank alone can: an all-gather hands back copies of
this rank's input, a reduce-scatter its own chunk, an all-to-all its own input, a receive zeros) and runs
meshtron's real training loop for a few steps on the real device: its TP
shards, FSDP shards, pipeline stage, context-parallel tiles and experts, with its share of the global
batch. What that rank holds and how long its computation takes are measured; what the other ranks would
have sent is not, so:

* losses are meaningless (the data of other ranks never arrives) and are not reported, but finite: the
  run's ``train.on_nonfinite`` applies as configured, and a non-finite step is a real finding;
* ``step_s`` is the step without communication: compare it with the planner's compute time;
* expert parallelism: each rank receives exactly as many (token, expert) rows as it sends, which is what
  balanced routing gives (the fake all-to-all returns the sender's own counts);
* nothing is saved: no checkpoints, no trackers; ``rehearsal.json`` and ``config.toml`` go to ``run.output_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.config import Config, save_config
from meshtron.errors import ConfigError

DEFAULT_STEPS = 4
"""Steps a rehearsal trains: the first compiles and warms the allocator, the second is where activations are
measured, the rest are timed."""

BALANCED_ROUTING_NOTE = (
    "expert parallelism: each rank receives as many (token, expert) rows as it sends (balanced routing assumed)"
)


@dataclass(frozen=True)
class Rehearsal:
    """What one rehearsed rank measured and what the planner predicts for it."""

    rank: int
    world_size: int
    layout: str
    device: str
    measured: dict
    """``state_bytes`` (parameters + gradients + optimizer state), ``activation_bytes`` (autograd's peak on the
    device), ``host_activation_bytes`` (what ``train.activation_offload`` held in host memory at its peak),
    ``reference_bytes`` (a ``model`` reference's parameters: ``preference.reference=model``), ``teacher_bytes``
    (a distillation teacher's parameters on this rank: ``train.objective=distill``),
    ``peak_bytes`` (the device's peak allocation; on CPU the process's peak resident memory), ``step_s``
    (median step time after the first, communication excluded)."""
    planned: dict
    """The planner's figures for this rank's pipeline position (``meshtron.plan.memory`` /
    ``meshtron.plan.throughput``); step times only for a GPU the planner knows."""
    notes: list[str]
    output_dir: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def rehearsal_config(cfg: Config, steps: int) -> Config:
    """``cfg`` for a rehearsal: ``steps`` steps, nothing saved or resumed, no trackers, only the metrics file."""
    if steps < 2:
        raise ConfigError(f"--rehearse-steps must be at least 2 (one to warm up, one to measure), got {steps}")
    # as configured, but a rollback has nothing to roll back to (a rehearsal saves nothing): stop instead
    on_nonfinite = "error" if cfg.train.on_nonfinite == "rollback" else cfg.train.on_nonfinite
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps=steps, on_nonfinite=on_nonfinite),
        checkpoint=dataclasses.replace(cfg.checkpoint, interval=0, resume="none"),
        run=dataclasses.replace(
            cfg.run,
            loggers=["jsonl"],
            output_dir=cfg.run.output_dir or str(Path("runs") / f"rehearse-{datetime.now().strftime('%Y%m%d-%H%M%S')}"),
        ),
    )
    return cfg


def _device(setting: str) -> torch.device:
    from meshtron.distributed.devices import resolve_device_type

    if resolve_device_type(setting, 1) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rehearse(cfg: Config, world_size: int, rank: int = 0, steps: int = DEFAULT_STEPS) -> Rehearsal:
    """Train rank ``rank`` of a ``world_size``-rank run of ``cfg`` alone for ``steps`` steps; measure it."""
    from meshtron.distributed.one_rank_group import one_rank_group
    from meshtron.distributed.runtime import Runtime
    from meshtron.metrics.memory import max_memory_gb
    from meshtron.plan.for_run import planned_for_rank
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.setup.run_setup import resolved_config
    from meshtron.train.trainer import train

    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank} is not a rank of a world of {world_size}; use 0..{world_size - 1}")
    if dist.is_initialized():
        raise ConfigError("--rehearse runs one process; start it without torchrun")
    cfg = rehearsal_config(cfg, steps)
    device = _device(cfg.run.device)
    setup = preflight(cfg, world_size, device.type)  # the full layout's checks, before anything is built
    cfg = resolved_config(cfg, setup)  # as the run records it: this rank's config.toml below
    notes = ["step_s excludes communication (collectives move no data); compare it with planned compute_s"]
    if setup.dims.ep > 1:
        notes.append(BALANCED_ROUTING_NOTE)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with one_rank_group(rank, world_size):
        runtime = Runtime(rank=rank, local_rank=0, world_size=world_size, device=device, rehearsal=True)
        result = train(cfg, runtime, setup)
    timed = result.step_seconds[1:] or result.step_seconds
    measured = {
        "state_bytes": sum(result.state_bytes.values()),
        "activation_bytes": result.activation_bytes,
        "host_activation_bytes": result.offloaded_bytes,
        "reference_bytes": result.reference_bytes,
        "teacher_bytes": result.teacher_bytes,
        "peak_bytes": int(max_memory_gb(device) * 2**30),
        "step_s": statistics.median(timed),
    }
    skipped = sum(not math.isfinite(loss) for loss in result.losses)
    if skipped:  # train.on_nonfinite = "skip" (the collectives' outputs are finite: the model's own values)
        notes.append(
            f"{skipped} of {len(result.losses)} steps had a non-finite loss or gradient and skipped their update"
            + ("; state_bytes was not measured" if not measured["state_bytes"] else "")
        )
    if device.type == "cpu":
        notes.append("peak_bytes on CPU is the process's peak resident memory (Python and libraries included)")
    planned, plan_notes = planned_for_rank(cfg, world_size, rank, device, setup.hf_config)
    report = Rehearsal(
        rank, world_size, setup.dims.describe(), str(device), measured, planned, notes + plan_notes, cfg.run.output_dir
    )
    output_dir = Path(cfg.run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not (output_dir / "config.toml").exists():
        save_config(cfg, output_dir / "config.toml")
    (output_dir / "rehearsal.json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return report


def format_rehearsal(report: Rehearsal) -> str:
    """The side-by-side table ``meshtron train --rehearse`` prints."""
    rows = [
        ("state (params + grads + optimizer)", "state_bytes"),
        ("activations kept for backward", "activation_bytes"),
        ("peak memory", "peak_bytes"),
    ]
    if report.planned.get("host_activation_bytes") or report.measured.get("host_activation_bytes"):
        rows.insert(2, ("activations in host memory", "host_activation_bytes"))
    if report.planned.get("reference_bytes") or report.measured.get("reference_bytes"):
        rows.insert(1, ("reference model (parameters)", "reference_bytes"))
    if report.planned.get("teacher_bytes") or report.measured.get("teacher_bytes"):
        rows.insert(1, ("teacher (parameters)", "teacher_bytes"))
    lines = [
        f"meshtron rehearsal: rank {report.rank} of {report.world_size} ({report.layout}) on {report.device}",
        f"{'':36} {'measured':>12} {'planned':>12} {'diff':>8}",
    ]
    for label, key in rows:
        got, want = report.measured[key], report.planned[key]
        comparable = want and (key != "peak_bytes" or report.device.startswith("cuda"))
        diff = f"{(got - want) / want:+.1%}" if comparable else ""
        lines.append(f"{label:36} {got / 1e9:>9.3f} GB {want / 1e9:>9.3f} GB {diff:>8}")
    step, compute = report.measured["step_s"], report.planned["compute_s"]
    planned_step = f"{compute:>10.4f} s" if compute is not None else f"{'-':>12}"
    diff = f"{(step - compute) / compute:+.1%}" if compute else ""
    lines.append(f"{'step without communication':36} {step:>10.4f} s {planned_step} {diff:>8}")
    if report.planned["step_s"] is not None:
        lines.append(f"{'planned step with communication':36} {'':>12} {report.planned['step_s']:>10.4f} s")
    lines += [f"note: {note}" for note in report.notes]
    lines.append(f"wrote {Path(report.output_dir) / 'rehearsal.json'}")
    return "\n".join(lines)
