"""Measure activation memory: the bytes autograd keeps for backward, at their peak during a step.

Works on any device (CPU included), under every parallelism: each tensor that autograd saves passes
through a ``saved_tensors_hooks`` pack hook; a storage counts once however many views of it are saved,
from the first save until the last graph node holding it is freed (after its backward). Parameters
(and views of them, e.g. a weight transposed for a matmul; with ``ResidentStorages``, any tensor sharing their
storage, as compiled code's unwrapped DTensor shards do) are not activations and are skipped.

Under activation checkpointing this counts what the checkpoints keep (each block's inputs); the
tensors a block saves while it is recomputed in backward, one block at a time, are not counted, nor what a tiled MLP's
tiles save while they are recomputed in backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from meshtron.distributed.precision import COMPUTE_WEIGHTS_ATTRIBUTE
from meshtron.tensors import storage_address


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds the bytes: a DTensor's local shard, a pending collective's result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(tensor, (DTensor, AsyncCollectiveTensor)):
        tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor.elem
    return tensor


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread. Saved-tensor hooks stay active there: a function
    that recomputes its forward in backward (a tiled MLP's tiles) saves tensors that live for one piece of the
    backward, transient memory rather than activations kept for backward (activation checkpointing's recomputation
    saves through hooks of its own, never the step's)."""
    return torch._C._current_graph_task_id() != -1


class ResidentStorages:
    """A model's parameters and mixed precision's weight copies, recognized by storage: compiled code saves a DTensor
    parameter's local tensor, which is neither a Parameter nor a view of one but shares its storage. Made at a step's
    start (FSDP's gathered parameters, new storages each gather, are Parameters when saved)."""

    def __init__(self, model: nn.Module):
        self._parameters = {storage_address(param) for param in model.parameters()} - {0}
        self._weights = [
            weights for module in model.modules() if (weights := module.__dict__.get(COMPUTE_WEIGHTS_ATTRIBUTE))
        ]

    def parameter(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares a parameter's storage."""
        return storage_address(tensor) in self._parameters

    def weight_copy(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares a compute-dtype weight copy's storage (meshtron.distributed.precision)."""
        address = storage_address(tensor)
        return any(weights.holds(address) for weights in self._weights)


def is_parameter(tensor: torch.Tensor, resident: ResidentStorages | None = None) -> bool:
    """A parameter, or a view of one (a weight transposed for a matmul), or with ``resident`` a tensor sharing a
    parameter's storage (what compiled code saves of a DTensor parameter): not an activation."""
    if isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter):
        return True
    return resident is not None and resident.parameter(tensor)


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

    resident: ResidentStorages | None = None
    """The model's parameters by storage (else only Parameters and their views are recognized)."""
    live_bytes: int = 0
    peak_bytes: int = 0
    _refs: dict = field(default_factory=dict)

    def _pack(self, tensor: torch.Tensor):
        if in_backward() or is_parameter(tensor, self.resident):
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
