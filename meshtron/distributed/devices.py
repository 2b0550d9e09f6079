"""Which device a process computes on and which PyTorch it runs: needed by the parallelisms and the run's start-up."""

from __future__ import annotations

import torch

from meshtron.errors import ConfigError


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu128``."""
    major, minor = (
        int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split("+")[0].split(".")[:2]
    )
    return major, minor


def resolve_device_type(setting: str, local_processes: int) -> str:
    """``cuda`` or ``cpu`` for ``run.device`` (auto | cpu | cuda); a ConfigError when the GPUs do not suffice.

    Called before any process-group work, so every rank refuses the same way.
    """
    if setting == "cpu":
        return "cpu"
    available = torch.cuda.is_available()
    if not available:
        if setting == "cuda":
            raise ConfigError("run.device=cuda but no CUDA GPU is visible; use --run.device=cpu")
        return "cpu"
    gpus = torch.cuda.device_count()
    if local_processes > gpus:
        raise ConfigError(
            f"{local_processes} processes on this machine but only {gpus} GPU(s) visible (one GPU per process); "
            f"use --nproc {gpus} (or torchrun --nproc-per-node {gpus}) or --run.device=cpu"
        )
    return "cuda"
