"""Activation offloading (``train.activation_offload``): the tensors autograd keeps for backward go to host memory
during the forward and come back for backward (docs/long-context.md#activation-offloading-trainactivation_offload).

One ``saved_tensors_hooks`` pair around the step's forwards, where meshtron measures activations too. With
activation checkpointing, what autograd keeps outside the recomputed blocks is each block's input (and the
embeddings', the final norm's and the loss's inputs); those go to the host and each block recomputes from its input
brought back. Without checkpointing, every saved activation goes.

On CUDA a tensor is copied into pinned host memory (in pieces of fixed sizes, which torch's caching host allocator
neither rounds up nor keeps apart: ``pinned_piece_sizes``) on a side stream that waits for the forward that produced it;
the caching allocator does not reuse its device memory before the copy has read it (``record_stream``). In backward,
fetching one tensor also starts copying the ones saved just before it by the same forward call (the next ones
backward needs; under pipeline schedules the ones saved before it may be another stage's or micro-batch's) on the side
stream, so the copies overlap the recomputation and gradients of the block in between. Copies change no value:
training is exact.

On CPU the host *is* the device: the tensors are copied all the same (nothing is saved), and the same bookkeeping
(what is fetched when, fetching ahead) runs, with ``HostTransfers`` in place of ``CudaTransfers``' streams and
events. The CPU tests therefore cover all of it but the CUDA calls themselves, under every parallelism.

Kept on the device: what is saved while a backward runs (a tiled MLP's recomputed tiles); parameters and views of
them, and mixed precision's compute-dtype weight copies (they live there through the step anyway), recognized by
storage too (compiled code saves a DTensor weight's local tensor); tensors smaller than ``min_bytes``; and tensor
subclasses other than DTensor (whose local shard is offloaded, a pending collective's result included).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from meshtron.distributed.activation_memory.measure import (
    ResidentStorages,
    SavedActivationTracker,
    in_backward,
    is_parameter,
)
from meshtron.distributed.precision import is_weight_copy
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

    __slots__ = (
        "host",
        "device",
        "copied",
        "fetched",
        "fetched_ready",
        "index",
        "used",
        "nbytes",
        "owner",
        "source",
        "version",
        "ahead",
        "forward_call",
        "__weakref__",
    )

    def __init__(self, host, nbytes: int, device: torch.device, copied, index: int, owner, source, version: int):
        self.host, self.device, self.copied, self.index, self.owner = host, device, copied, index, owner
        self.forward_call = owner.forward_call  # the model (or stage) forward that saved it
        # a weak reference to the device storage and the version of its views when copied: while both hold, a new
        # view of the storage shares this copy (an in-place change in between makes a new one)
        self.source, self.version = source, version
        self.fetched: torch.Tensor | None = None  # its bytes on the device, once fetched
        self.ahead = False  # fetched ahead, beside the compute, and not yet waited for
        self.fetched_ready = None  # the event that marks that copy done
        self.used = False
        self.nbytes = nbytes
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
    those saved just before it by the same forward call, newest first, not yet used or fetched, while their bytes
    (with those already fetched ahead) fit in ``budget_bytes``. ``order`` holds weak references in pack order.

    Never across forward calls: under interleaved and zero-bubble pipeline schedules the tensors saved just before
    a stage's micro-batch are often another stage's or micro-batch's, whose backward comes much later."""
    chosen, in_flight = [], 0
    unpacked = order[unpacked_index]()
    for ref in reversed(order[:unpacked_index]):
        handle = ref()
        if handle is None or handle.used:
            continue
        if unpacked is not None and handle.forward_call != unpacked.forward_call:
            break
        if in_flight + handle.nbytes > budget_bytes:
            break
        in_flight += handle.nbytes
        if handle.fetched is None:
            chosen.append(handle)
    return chosen


PINNED_PIECE_BYTES = 64 << 20
"""The pinned pieces a host copy is made of on CUDA (then ``PINNED_TAIL_BYTES`` ones for the rest)."""

PINNED_TAIL_BYTES = 1 << 20
"""The pieces that hold what is left of a host copy after its ``PINNED_PIECE_BYTES`` pieces."""


def pinned_piece_sizes(nbytes: int) -> list[int]:
    """The pinned buffers one host copy of ``nbytes`` takes: ``PINNED_PIECE_BYTES`` pieces, then ``PINNED_TAIL_BYTES``
    ones. Both are powers of two: torch's caching host allocator rounds each request up to one (a 3.59 GB tensor in one
    request would take 4 GiB) and reuses a freed block only for a request of the same rounded size, so the pieces take
    the copy's bytes rounded up to ``PINNED_TAIL_BYTES``, and the pieces freed by one copy serve any later copy."""
    whole, rest = divmod(nbytes, PINNED_PIECE_BYTES)
    return [PINNED_PIECE_BYTES] * whole + [PINNED_TAIL_BYTES] * -(-rest // PINNED_TAIL_BYTES)


def pinned_bytes(nbytes: int) -> int:
    """The pinned memory one host copy of ``nbytes`` takes (``pinned_piece_sizes``)."""
    return sum(pinned_piece_sizes(nbytes))


def _pinned(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


class PinnedPieces:
    """One host copy of ``nbytes`` bytes in pinned pieces (``pinned_piece_sizes``, each made by ``pin``), and the
    copies between it and a flat byte tensor, piece by piece (asynchronous on CUDA's current stream)."""

    def __init__(self, nbytes: int, pin=_pinned):
        self.nbytes = nbytes
        self.pieces = [pin(size) for size in pinned_piece_sizes(nbytes)]

    def _spans(self):
        start = 0
        for piece in self.pieces:
            length = min(piece.numel(), self.nbytes - start)
            yield piece[:length], slice(start, start + length)
            start += length

    def copy_from(self, source: torch.Tensor) -> None:
        """Fill the pieces with ``source`` (flat bytes)."""
        for piece, span in self._spans():
            piece.copy_(source[span], non_blocking=True)

    def to(self, device: torch.device) -> torch.Tensor:
        """The bytes as one flat tensor on ``device``."""
        fetched = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for piece, span in self._spans():
            fetched[span].copy_(piece, non_blocking=True)
        return fetched


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
    """Pinned host memory (in pieces: ``PinnedPieces``) and a side stream: copies to the host wait for the kernels
    that made the tensor, and the caching allocator does not reuse a tensor's memory before its copy has read it, nor
    a fetched-ahead copy's before the compute stream is done with it (``record_stream``)."""

    def __init__(self, device: torch.device):
        self.device, self.stream = device, torch.cuda.Stream(device)

    def to_host(self, source: torch.Tensor):
        host = PinnedPieces(source.numel())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_from(source)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        source.record_stream(self.stream)
        return host, copied

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def to_device(self, host: PinnedPieces, device: torch.device) -> torch.Tensor:
        return host.to(device)

    def to_device_ahead(self, host: PinnedPieces, device: torch.device):
        with torch.cuda.stream(self.stream):  # after this stream's copies to the host
            fetched = host.to(device)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return fetched, ready

    def adopt(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))


class ActivationOffloader:
    """Moves saved activations to host memory in forward and back in backward; ``hooks()`` is the context.

    ``tracker``: the activation measurement, which then counts what stays on the device; ``resident``: the model's
    parameters and weight copies by storage (what compiled blocks save of them stays). ``offloaded_bytes`` /
    ``peak_offloaded_bytes``: the host bytes held now / at most."""

    def __init__(
        self,
        device: torch.device,
        tracker: SavedActivationTracker | None = None,
        min_bytes: int | None = None,
        transfers: HostTransfers | None = None,
        resident: ResidentStorages | None = None,
    ):
        cuda = device.type == "cuda"
        self.min_bytes = (MIN_OFFLOAD_BYTES_CUDA if cuda else 0) if min_bytes is None else min_bytes
        self.tracker, self.resident = tracker, resident
        self.transfers = transfers or (CudaTransfers(device) if cuda else HostTransfers())
        self._order: list[weakref.ref] = []  # the host copies, in the order they were made
        self._copies: dict[int, weakref.ref] = {}  # device storage address -> its host copy
        self._largest = 0
        self.forward_call = 0  # counts the forward calls (``forward_calls``): fetching ahead stays within one
        self.offloaded_bytes = 0
        self.peak_offloaded_bytes = 0

    def hooks(self):
        """The ``saved_tensors_hooks`` context for the step's forwards. The hooks run eagerly: compiled code that
        saves tensors in an autograd.Function (a tiled MLP's) would otherwise trace them, making copies of the
        bookkeeping objects without running their ``__init__``."""
        pack = compile_disabled(lambda tensor: self._pack(tensor))  # (functions: a bound method takes no attributes)
        unpack = compile_disabled(lambda handle: self._unpack(handle))
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def forward_calls(self, modules):
        """Count each forward call of ``modules`` (the model, or this rank's pipeline stages: one call per stage and
        micro-batch), so that backward fetches ahead only what the same call saved."""

        def next_call(*_):
            self.forward_call += 1

        handles = [module.register_forward_pre_hook(next_call) for module in modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _offloadable(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """None when ``tensor`` stays on the device, else the plain tensor to offload (``_local_part``)."""
        if tensor.layout != torch.strided or is_parameter(tensor, self.resident) or is_weight_copy(tensor):
            return None
        if self.resident is not None and self.resident.weight_copy(tensor):
            return None
        if type(tensor) not in (torch.Tensor, nn.Parameter, DTensor):
            return None
        local = _local_part(tensor)
        if type(local) is not torch.Tensor or local.numel() * local.element_size() < max(self.min_bytes, 1):
            return None
        return local

    def _pack(self, tensor: torch.Tensor):
        local = None if in_backward() else self._offloadable(tensor)
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
        index, source_ref = len(self._order), StorageWeakRef(storage)
        copy = _HostCopy(host, source.numel(), device, copied, index, self, source_ref, tensor._version)
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
def saved_activation_hooks(offloader: ActivationOffloader | None, tracker: SavedActivationTracker | None, modules=()):
    """The step's hooks on saved tensors: the offloader's (counting what stays on the device with ``tracker``; each
    forward call of ``modules`` apart), or the tracker's alone, or none."""
    if offloader is not None:
        with offloader.hooks(), offloader.forward_calls(modules):
            yield
    elif tracker is not None:
        with tracker.track():
            yield
    else:
        yield
