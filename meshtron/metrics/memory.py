"""Memory of one rank: bytes of its local shards (parameters, gradients, optimizer state) and its peak."""

from __future__ import annotations

import resource

import torch

from meshtron.tensors import local_tensor


def local_bytes(tensor) -> int:
    """Bytes of this rank's piece of ``tensor`` (a DTensor's local shard); 0 for None."""

    if tensor is None:
        return 0
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only)."""
    params = list(model.parameters())
    optim = sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": optim,
    }


def pinned_state_bytes(model: torch.nn.Module) -> int:
    """The pinned host memory FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` takes for this rank's state: each parameter
    shard, and each trained one's gradient shard, pinned in a request of its own, which torch's caching host allocator
    rounds up to a power of two (the optimizer state is not pinned)."""
    total = 0
    for param in model.parameters():
        nbytes = local_bytes(param)
        total += (1 << (nbytes - 1).bit_length() if nbytes else 0) * (1 + param.requires_grad)
    return total


def max_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated GPU memory on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20
