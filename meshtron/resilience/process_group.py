"""Joining the process group torchrun describes, aware of restarts (each attempt's own rendezvous keys) and of
hangs (NCCL's flight recorder, which the watchdog writes out): the ``Runtime`` every layer is handed."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtron.distributed.devices import resolve_device_type
from meshtron.distributed.runtime import Runtime, process_group_backend
from meshtron.distributed.torchrun_env import launched_by_torchrun, launched_world_size, local_world_size
from meshtron.resilience.restart import attempt_store, restart_count
from meshtron.resilience.watchdog import enable_flight_recorder


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
