"""The planner's figures for one rank of a run as configured: what ``meshtron train --rehearse`` prints beside its
measurements, and what every GPU run's ``metrics.jsonl`` carries beside its own (``planned_peak_gb``,
``planned_step_s``; meshtron.train.run.planned), so that each user sees how far the planner is off on their hardware.
"""

from __future__ import annotations

import torch

from meshtron.config import Config
from meshtron.plan.hardware import GPUS, Hardware
from meshtron.train.run.planned import PlannedFigures


def known_gpu(device: torch.device) -> str | None:
    """The planner's name of this CUDA device (``h100``, ``h200``, ...), or None (not CUDA, or a GPU it does not
    know)."""
    if device.type != "cuda":
        return None
    return gpu_key(torch.cuda.get_device_name(device))


def gpu_key(device_name: str) -> str | None:
    """The planner's name for a CUDA device name (``NVIDIA H100 80GB HBM3`` -> ``h100``; ``NVIDIA A100-SXM4-40GB``
    -> ``a100-40gb``), or None."""
    name = device_name.lower().replace(" ", "")
    matches = [key for key in GPUS if all(part in name for part in key.split("-"))]
    return max(matches, key=len) if matches else None


def planned_for_rank(cfg: Config, world_size: int, rank: int, device: torch.device, hf_config):
    """``(planned, notes)``: the planner's bytes and seconds for global rank ``rank`` (its pipeline position) of a
    ``world_size``-rank run of ``cfg`` on ``device``: ``state_bytes`` (as measured after the first update),
    ``activation_bytes``, ``host_activation_bytes``, ``reference_bytes`` (a ``model`` reference's parameters),
    ``teacher_bytes`` (a distillation teacher's), ``peak_bytes``, and ``step_s`` / ``compute_s`` for a GPU the
    planner knows (else None, with a note). ``hf_config``: the run's model config (preflight's)."""
    from meshtron.plan.memory import config_view, memory_per_pipeline_rank
    from meshtron.plan.throughput import estimate_step

    shape, layout, workload = config_view(cfg, world_size, device.type, hf_config)
    pp_rank = rank // (world_size // layout.dims.pp)
    memory = memory_per_pipeline_rank(shape, layout, workload)[pp_rank]
    # state as measured after the first update: gradients sharded like their parameters (memory.grads is the
    # larger of that and what is held between micro-batches, which is measured apart)
    planned: dict[str, float | None] = {
        "state_bytes": 2 * memory.params + memory.optimizer,
        "activation_bytes": memory.activations,
        "host_activation_bytes": memory.host_activations,
        "reference_bytes": memory.reference,
        "teacher_bytes": memory.teacher,
        "peak_bytes": memory.total,
        "step_s": None,
        "compute_s": None,
    }
    notes = []
    gpu = known_gpu(device)
    if gpu is None:
        notes.append("no planner step time: the planner models GPUs (" + ", ".join(GPUS) + ") only")
    else:
        step = estimate_step(shape, layout, workload, GPUS[gpu], hf_config)
        planned.update(step_s=step.seconds, compute_s=step.compute_s)
    return planned, notes


def planned_figures(cfg: Config, world_size: int, rank: int, device: torch.device, hf_config) -> PlannedFigures | None:
    """What a GPU run's metrics rows compare with: the planner's peak memory of ``rank`` and step time for the run's
    own layout and settings. None off CUDA: the planner models GPU memory, and a CPU run's ``max_memory_gb`` is the
    process's resident memory."""
    if device.type != "cuda":
        return None
    planned, _ = planned_for_rank(cfg, world_size, rank, device, hf_config)
    gpu = known_gpu(device)
    return PlannedFigures(
        peak_gb=planned["peak_bytes"] / 2**30,  # the unit of max_memory_gb (torch's max_memory_allocated / 2**30)
        step_s=planned["step_s"],
        hardware=_describe(GPUS[gpu]) if gpu else torch.cuda.get_device_name(device),
    )


def _describe(hw: Hardware) -> str:
    return f"the planner's {hw.name}"
