"""Activation offloading (``train.activation_offload``): the tensors autograd keeps for backward go to host memory
during the forward and come back for backward (docs/long-context.md#activation-offloading-trainactivation_offload).

One ``saved_tensors_hooks`` pair around the step's forwards, where meshtron measures activations too. With
activation checkpointing, what autograd keeps outside the recomputed blocks is each block's input (and the
embeddings', the final norm's and the loss's inputs); those go to the host and each block recomputes from its input
brought back. Without checkpointing, every saved activation goes.

On CUDA a tensor is copied into pinned host memory on a side stream that waits for the forward that produced it;
the caching allocator does not reuse its device memory before the copy has read it (``record_stream``). In backward,
fetching one tensor also starts copying the ones saved just before it (the next ones backward needs) on the side
stream, so the copies overlap the recomputation and gradients of the block in between. Copies change no value:
training is exact.

On CPU the host *is* the device: the tensors are copied all the same (nothing is saved), which lets the CPU tests
run this code under every parallelism.

Kept on the device: parameters and views of them (they live there anyway), tensors smaller than
``min_bytes``, and tensor subclasses other than DTensor (whose local shard is offloaded).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from meshtron.metrics.activations import SavedActivationTracker
from meshtron.tensors import compile_disabled

MIN_OFFLOAD_BYTES_CUDA = 1 << 20
"""Below this a tensor stays on the GPU: its copy would cost more in launch overhead than its bytes are worth."""


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


class _HostCopy:
    """The host copy of one device storage (every saved view of it shares it), and its way back."""

    __slots__ = ("host", "device", "copied", "fetched", "fetched_ready", "index", "used", "nbytes", "owner", "source")
    __slots__ += ("version", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, index: int, owner, source, version: int):
        self.host, self.device, self.copied, self.index, self.owner = host, device, copied, index, owner
        # a weak reference to the device storage and the version of its views when copied: while both hold, a new
        # view of the storage shares this copy (an in-place change in between makes a new one)
        self.source, self.version = source, version
        self.fetched: torch.Tensor | None = None  # the device copy started ahead of its use
        self.fetched_ready = None  # the side stream's event after that copy
        self.used = False
        self.nbytes = host.numel()
        owner.offloaded_bytes += self.nbytes
        owner.peak_offloaded_bytes = max(owner.peak_offloaded_bytes, owner.offloaded_bytes)

    def __del__(self):  # autograd freed the last graph node that kept a view of it
        self.owner.offloaded_bytes -= self.nbytes


class _Offloaded:
    """What autograd keeps in place of an offloaded tensor: its storage's host copy and the view to rebuild."""

    __slots__ = ("copy", "dtype", "offset", "size", "stride", "dtensor_spec")

    def __init__(self, copy: _HostCopy, tensor: torch.Tensor, dtensor_spec):
        self.copy, self.dtype, self.dtensor_spec = copy, tensor.dtype, dtensor_spec
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()

    def view_of(self, storage_bytes: torch.Tensor) -> torch.Tensor:
        """This tensor, as a view of ``storage_bytes`` (the storage's bytes on the device)."""
        empty = torch.empty(0, dtype=self.dtype, device=storage_bytes.device)
        return empty.set_(storage_bytes.untyped_storage(), self.offset, self.size, self.stride)


class _Kept:
    """A tensor left on the device (wrapping the activation tracker's handle when one measures)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def prefetch_candidates(order: list, unpacked_index: int, budget_bytes: int) -> list:
    """The offloaded tensors to start bringing back after the one at ``unpacked_index`` (pack order) was fetched:
    those saved just before it, newest first, not yet used or fetched, while their bytes (with those already fetched
    ahead) fit in ``budget_bytes``. ``order`` holds weak references in pack order."""
    chosen, in_flight = [], 0
    for ref in reversed(order[:unpacked_index]):
        handle = ref()
        if handle is None or handle.used:
            continue
        if in_flight + handle.nbytes > budget_bytes:
            break
        in_flight += handle.nbytes
        if handle.fetched is None:
            chosen.append(handle)
    return chosen


class ActivationOffloader:
    """Moves saved activations to host memory in forward and back in backward; ``hooks()`` is the context.

    ``tracker``: the activation measurement, which then counts what stays on the device. ``offloaded_bytes`` /
    ``peak_offloaded_bytes``: the host bytes held now / at most."""

    def __init__(
        self, device: torch.device, tracker: SavedActivationTracker | None = None, min_bytes: int | None = None
    ):
        self.device = device
        self.cuda = device.type == "cuda"
        self.min_bytes = (MIN_OFFLOAD_BYTES_CUDA if self.cuda else 0) if min_bytes is None else min_bytes
        self.tracker = tracker
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._order: list[weakref.ref] = []  # the host copies, in the order they were made
        self._copies: dict[int, weakref.ref] = {}  # device storage address -> its host copy
        self._largest = 0
        self.offloaded_bytes = 0
        self.peak_offloaded_bytes = 0

    def hooks(self):
        """The ``saved_tensors_hooks`` context for the step's forwards. The hooks run eagerly: compiled code that
        saves tensors in an autograd.Function (a tiled MLP's) would otherwise trace them, making copies of the
        bookkeeping objects without running their ``__init__``."""
        pack = compile_disabled(lambda tensor: self._pack(tensor))  # (functions: a bound method takes no attributes)
        unpack = compile_disabled(lambda handle: self._unpack(handle))
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _keeps(self, tensor: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        if _is_parameter(tensor) or tensor.layout != torch.strided:
            return True
        if type(tensor) not in (torch.Tensor, nn.Parameter, DTensor):
            return True
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        return type(local) is not torch.Tensor or local.numel() * local.element_size() < max(self.min_bytes, 1)

    def _pack(self, tensor: torch.Tensor):
        from torch.distributed.tensor import DTensor

        if self._keeps(tensor):
            return _Kept(self.tracker._pack(tensor) if self.tracker is not None else tensor)
        spec = None
        if isinstance(tensor, DTensor):
            spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            tensor = tensor._local_tensor
        return _Offloaded(self._host_copy(tensor), tensor, spec)

    def _host_copy(self, tensor: torch.Tensor) -> _HostCopy:
        """The host copy of ``tensor``'s storage: the one made for an earlier view of it while the storage lives
        unchanged, else a new one."""
        from torch.multiprocessing.reductions import StorageWeakRef

        storage, device = tensor.untyped_storage(), tensor.device
        known = self._copies.get(storage.data_ptr())
        known = known() if known is not None else None
        if known is not None and not known.source.expired() and known.version == tensor._version:
            return known
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=self.cuda)
        copied = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                host.copy_(source, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            source.record_stream(self.stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(source)
        copy = _HostCopy(host, device, copied, len(self._order), self, StorageWeakRef(storage), tensor._version)
        self._order.append(weakref.ref(copy))
        self._copies[storage.data_ptr()] = self._order[-1]
        self._largest = max(self._largest, copy.nbytes)
        return copy

    def _unpack(self, handle):
        if isinstance(handle, _Kept):
            return self.tracker._unpack(handle.value) if self.tracker is not None else handle.value
        copy = handle.copy
        restored = handle.view_of(self._fetch(copy) if self.cuda else copy.host.to(copy.device))
        copy.used = True
        if handle.dtensor_spec is None:
            return restored
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = handle.dtensor_spec
        with torch.no_grad():
            return DTensor.from_local(restored, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _fetch(self, copy: _HostCopy) -> torch.Tensor:
        """``copy``'s bytes on the device: fetched ahead, or copied now; then the next ones are fetched ahead."""
        current = torch.cuda.current_stream(copy.device)
        if copy.fetched is None:
            current.wait_event(copy.copied)
            copy.fetched = copy.host.to(copy.device, non_blocking=True)
        elif copy.fetched_ready is not None:  # fetched ahead on the side stream
            current.wait_event(copy.fetched_ready)
            copy.fetched.record_stream(current)  # allocated on the side stream, used on this one
            copy.fetched_ready = None
        restored = copy.fetched  # kept for the storage's other views until autograd frees the copy
        for ahead in prefetch_candidates(self._order, copy.index, 2 * self._largest):
            with torch.cuda.stream(self.stream):  # after the device-to-host copies on this stream
                ahead.fetched = ahead.host.to(ahead.device, non_blocking=True)
                ahead.fetched_ready = torch.cuda.Event()
                ahead.fetched_ready.record(self.stream)
        return restored


@contextlib.contextmanager
def saved_activation_hooks(offloader: ActivationOffloader | None, tracker: SavedActivationTracker | None):
    """The step's hooks on saved tensors: the offloader's (counting what stays on the device with ``tracker``), or
    the tracker's alone, or none."""
    if offloader is not None:
        with offloader.hooks():
            yield
    elif tracker is not None:
        with tracker.track():
            yield
    else:
        yield
