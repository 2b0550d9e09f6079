"""Process-group start-up: rank, world size, device and backend (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def launched_world_size() -> int:
    """World size given by torchrun's environment, 1 when started as a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_runtime(timeout_s: float = 1800) -> Runtime:
    """Join the process group that torchrun describes (if any) and pick this rank's device."""
    world_size = launched_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "RANK" in os.environ and not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return Runtime(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def shutdown_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
