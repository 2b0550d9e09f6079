"""Tensor helpers every layer may use (the lowest layer, beside config and errors)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (its shard, or the whole value when replicated); plain tensors pass through."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor sharded as ``like``: its mesh, placements, global shape and stride
    (no check across ranks)."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
