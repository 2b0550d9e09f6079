"""Measure activation memory: the bytes autograd keeps for backward, at their peak during a step.

Works on any device (CPU included), under every parallelism: each tensor that autograd saves passes
through a ``saved_tensors_hooks`` pack hook; a storage counts once however many views of it are saved,
from the first save until the last graph node holding it is freed (after its backward). Parameters
(and views of them, e.g. a weight transposed for a matmul) are not activations and are skipped.

Under activation checkpointing this counts what the checkpoints keep (each block's inputs); the
tensors a block saves while it is recomputed in backward, one block at a time, are not counted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds the bytes: a DTensor's local shard, a pending collective's result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(tensor, (DTensor, AsyncCollectiveTensor)):
        tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor.elem
    return tensor


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a weight transposed for a matmul): not an activation."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


class _Held:
    """What autograd keeps in place of a saved tensor; releasing it releases the tensor's bytes."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key, tracker: "SavedActivationTracker"):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        # getattr: torch.compile's tracing of the pack hook can make (and drop) one without running __init__
        if getattr(self, "key", None) is not None:
            self.tracker._release(self.key)


@dataclass
class SavedActivationTracker:
    """Live and peak bytes of the tensors autograd saves for backward while ``track()`` is active."""

    live_bytes: int = 0
    peak_bytes: int = 0
    _refs: dict = field(default_factory=dict)

    def _pack(self, tensor: torch.Tensor):
        if is_parameter(tensor):
            return _Held(tensor, None, self)
        local = _local(tensor)
        storage = local.untyped_storage()
        key = (local.device, storage.data_ptr())
        if key in self._refs:
            self._refs[key][0] += 1
        else:
            self._refs[key] = [1, storage.nbytes()]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return _Held(tensor, key, self)

    def _release(self, key) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    @contextlib.contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
