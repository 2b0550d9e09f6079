"""Process-group start-up: rank, world size, device and backend (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtron.distributed.devices import resolve_device_type, torch_release
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


def launched_world_size() -> int:
    """World size given by torchrun's environment, 1 when started as a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_by_torchrun() -> bool:
    """Whether a launcher (torchrun, or ``meshtron train --nproc`` through it) started this process as one rank."""
    return "RANK" in os.environ


def local_world_size(default: int = 1) -> int:
    """Processes on this machine (torchrun's LOCAL_WORLD_SIZE), ``default`` outside torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def process_group_backend(device_type: str, host_collectives: bool = False) -> str:
    """NCCL on GPUs, gloo on CPU; ``host_collectives`` (``fsdp.cpu_offload``, whose shards, gradients and
    optimizer state live in host memory) adds gloo for CPU tensors next to NCCL."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


def init_runtime(timeout_s: float = 1800, device: str = "auto", host_collectives: bool = False) -> Runtime:
    """Join the process group that torchrun describes (if any) and pick this rank's device (``run.device``).

    ``timeout_s`` (``run.collective_timeout_s``) is how long a collective may wait for the other ranks;
    ``host_collectives`` as in ``process_group_backend``.
    """
    world_size = launched_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if resolve_device_type(device, local_world_size()) == "cuda":
        chosen = torch.device("cuda", local_rank)
        torch.cuda.set_device(chosen)
    else:
        chosen = torch.device("cpu")
    backend = process_group_backend(chosen.type, host_collectives)
    if launched_by_torchrun() and not dist.is_initialized():
        from meshtron.resilience.restart import attempt_store, restart_count
        from meshtron.resilience.watchdog import enable_flight_recorder

        if "nccl" in backend:  # read when the group is created: the hang watchdog writes it out (docs/faults.md)
            enable_flight_recorder()

        kwargs = {"device_id": chosen} if chosen.type == "cuda" else {}
        timeout = timedelta(seconds=timeout_s)
        if restart_count() > 0:  # torchrun restarted the workers: this attempt's rendezvous keys apart
            kwargs.update(store=attempt_store(rank, world_size, timeout), rank=rank, world_size=world_size)
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    return Runtime(rank=rank, local_rank=local_rank, world_size=world_size, device=chosen)


def shutdown_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
