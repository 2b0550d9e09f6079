"""Tensor helpers every layer may use (the lowest layer, beside config and errors)."""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # loaded by DTensor's import anyway
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (its shard, or the whole value when replicated); plain tensors pass through."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_address(tensor: torch.Tensor) -> int:
    """The address of the storage that holds ``tensor``'s bytes on this rank: a DTensor's local shard's, a pending
    collective's result's (compiled code saves a DTensor's local tensor, which shares it); 0 for tensors without one
    (other subclasses, sparse layouts, empty storages)."""
    while isinstance(tensor, (DTensor, AsyncCollectiveTensor)):
        tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor.elem
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return 0
    return tensor.untyped_storage().data_ptr()


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor sharded as ``like``: its mesh, placements, global shape and stride
    (no check across ranks)."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def compile_disabled(fn):
    """``fn`` run eagerly (a graph break) when compiled code calls it, as ``torch.compiler.disable`` makes it, but set
    up at its first call: ``torch.compiler.disable`` imports dynamo (~0.9 s of CPU) when it decorates, so every
    process importing ``fn``'s module (a launcher, ``meshtron plan``) would load dynamo. ``torch._disable_dynamo`` is
    the lazy form torch uses for its own functions."""
    return torch._disable_dynamo(fn)
