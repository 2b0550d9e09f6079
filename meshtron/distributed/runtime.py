"""What a process knows of its run: rank, world size, device (``Runtime``), and the backend (NCCL on GPUs, gloo on
CPU). What torchrun's environment says: meshtron.distributed.torchrun_env; joining the group:
meshtron.resilience.process_group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.distributed.devices import torch_release
from meshtron.errors import ConfigError

MIN_TORCH = (2, 11)
"""The oldest PyTorch meshtron is tested with (pyproject.toml declares the same)."""


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    rehearsal: bool = False
    """One rank of a larger layout on a fake process group (``meshtron train --rehearse``): collectives
    move no data, so nothing may be learned from another rank (objects are not shared)."""

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def check_torch_version(version: str | None = None) -> None:
    """Refuse a PyTorch older than MIN_TORCH with one line naming the minimum."""
    version = version or torch.__version__
    if torch_release(version) < MIN_TORCH:
        minimum = ".".join(map(str, MIN_TORCH))
        raise ConfigError(f"meshtron needs torch >= {minimum}, found {version}; install torch>={minimum}")


def process_group_backend(device_type: str, host_collectives: bool = False) -> str:
    """NCCL on GPUs, gloo on CPU; ``host_collectives`` (``fsdp.cpu_offload``, whose shards, gradients and
    optimizer state live in host memory) adds gloo for CPU tensors next to NCCL."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
