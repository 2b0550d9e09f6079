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

On CPU the host *is* the device: the tensors are copied all the same (nothing is saved), and the same bookkeeping
(what is fetched when, fetching ahead) runs, with ``HostTransfers`` in place of ``CudaTransfers``' streams and
events. The CPU tests therefore cover all of it but the CUDA calls themselves, under every parallelism.

Kept on the device: parameters and views of them, and mixed precision's compute-dtype weight copies (they live
there through the step anyway), tensors smaller than ``min_bytes``, and tensor subclasses other than DTensor (whose
local shard is offloaded, a pending collective's result included).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from meshtron.distributed.precision import is_weight_copy
from meshtron.metrics.activations import SavedActivationTracker, is_parameter
from meshtron.tensors import compile_disabled

MIN_OFFLOAD_BYTES_CUDA = 1 << 20
"""Below this a tensor stays on the GPU: its copy would cost more in launch overhead than its bytes are worth."""


def _local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``tensor``'s bytes on this rank: a DTensor's local shard, and where that is a
    collective's result (sequence parallelism's all-gathered block inputs, an AsyncCollectiveTensor) the result
    itself: the op saving it has already waited for it, so waiting again costs nothing."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


class _HostCopy:
    """The host copy of one device storage (every saved view of it shares it), and its way back."""

    __slots__ = ("host", "device", "copied", "fetched", "fetched_ready", "index", "used", "nbytes", "owner", "source")
    __slots__ += ("version", "ahead", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, index: int, owner, source, version: int):
        self.host, self.device, self.copied, self.index, self.owner = host, device, copied, index, owner
        # a weak reference to the device storage and the version of its views when copied: while both hold, a new
        # view of the storage shares this copy (an in-place change in between makes a new one)
        self.source, self.version = source, version
        self.fetched: torch.Tensor | None = None  # its bytes on the device, once fetched
        self.ahead = False  # fetched ahead, beside the compute, and not yet waited for
        self.fetched_ready = None  # the event that marks that copy done
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


class HostTransfers:
    """The copies where the host is the device (CPU): made at once, nothing to wait for. The offloader's bookkeeping
    (which copy is fetched when, fetching ahead) runs as on CUDA, so the CPU tests cover it."""

    def to_host(self, source: torch.Tensor):
        """(host bytes, the event that marks the copy done) of ``source``'s bytes."""
        return source.clone(), None

    def wait(self, event) -> None:
        """The compute stream waits for ``event``."""

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` on ``device``, copied on the compute stream (here: the host copy itself)."""
        return host if device.type == "cpu" else host.to(device)

    def to_device_ahead(self, host: torch.Tensor, device: torch.device):
        """(``host`` on ``device``, the event that marks the copy done), copied beside the compute."""
        return self.to_device(host, device), None

    def adopt(self, tensor: torch.Tensor) -> None:
        """``tensor``, made beside the compute, is used by the compute stream from now on."""


class CudaTransfers(HostTransfers):
    """Pinned host memory and a side stream: copies to the host wait for the kernels that made the tensor, and the
    caching allocator does not reuse a tensor's memory before its copy has read it, nor a fetched-ahead copy's before
    the compute stream is done with it (``record_stream``)."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)

    def to_host(self, source: torch.Tensor):
        host = torch.empty(source.numel(), dtype=source.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        source.record_stream(self.stream)
        return host, copied

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device, non_blocking=True)

    def to_device_ahead(self, host: torch.Tensor, device: torch.device):
        with torch.cuda.stream(self.stream):  # after this stream's copies to the host
            fetched = host.to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return fetched, ready

    def adopt(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))


class ActivationOffloader:
    """Moves saved activations to host memory in forward and back in backward; ``hooks()`` is the context.

    ``tracker``: the activation measurement, which then counts what stays on the device. ``offloaded_bytes`` /
    ``peak_offloaded_bytes``: the host bytes held now / at most."""

    def __init__(
        self,
        device: torch.device,
        tracker: SavedActivationTracker | None = None,
        min_bytes: int | None = None,
        transfers: HostTransfers | None = None,
    ):
        cuda = device.type == "cuda"
        self.min_bytes = (MIN_OFFLOAD_BYTES_CUDA if cuda else 0) if min_bytes is None else min_bytes
        self.tracker = tracker
        self.transfers = transfers or (CudaTransfers(device) if cuda else HostTransfers())
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

    def _offloadable(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """None when ``tensor`` stays on the device, else the plain tensor to offload (``_local_part``)."""
        if is_parameter(tensor) or is_weight_copy(tensor) or tensor.layout != torch.strided:
            return None
        if type(tensor) not in (torch.Tensor, nn.Parameter, DTensor):
            return None
        local = _local_part(tensor)
        if type(local) is not torch.Tensor or local.numel() * local.element_size() < max(self.min_bytes, 1):
            return None
        return local

    def _pack(self, tensor: torch.Tensor):
        local = self._offloadable(tensor)
        if local is None:
            return _Kept(self.tracker._pack(tensor) if self.tracker is not None else tensor)
        spec = None
        if isinstance(tensor, DTensor):
            spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        return _Offloaded(self._host_copy(local), local, spec)

    def _host_copy(self, tensor: torch.Tensor) -> _HostCopy:
        """The host copy of ``tensor``'s storage: the one made for an earlier view of it while the storage lives
        unchanged, else a new one."""
        storage, device = tensor.untyped_storage(), tensor.device
        known = self._copies.get(storage.data_ptr())
        known = known() if known is not None else None
        if known is not None and not known.source.expired() and known.version == tensor._version:
            return known
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        host, copied = self.transfers.to_host(source)
        copy = _HostCopy(host, device, copied, len(self._order), self, StorageWeakRef(storage), tensor._version)
        self._order.append(weakref.ref(copy))
        self._copies[storage.data_ptr()] = self._order[-1]
        self._largest = max(self._largest, copy.nbytes)
        return copy

    def _unpack(self, handle):
        if isinstance(handle, _Kept):
            return self.tracker._unpack(handle.value) if self.tracker is not None else handle.value
        copy = handle.copy
        restored = handle.view_of(self._fetch(copy))
        copy.used = True
        if handle.dtensor_spec is None:
            return restored
        mesh, placements, shape, stride = handle.dtensor_spec
        with torch.no_grad():
            return DTensor.from_local(restored, mesh, placements, run_check=False, shape=shape, stride=stride)

    def _fetch(self, copy: _HostCopy) -> torch.Tensor:
        """``copy``'s bytes on the device: fetched ahead, or copied now; then the next ones are fetched ahead."""
        transfers = self.transfers
        if copy.fetched is None:
            transfers.wait(copy.copied)
            copy.fetched = transfers.to_device(copy.host, copy.device)
        elif copy.ahead:
            transfers.wait(copy.fetched_ready)
            transfers.adopt(copy.fetched)
            copy.ahead, copy.fetched_ready = False, None
        for later in prefetch_candidates(self._order, copy.index, 2 * self._largest):
            later.fetched, later.fetched_ready = transfers.to_device_ahead(later.host, later.device)
            later.ahead = True
        return copy.fetched  # kept for the storage's other views until autograd frees the copy


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
