"""The process group of a rehearsal (``meshtron train --rehearse``): one rank of a larger layout, alone.

The world is PyTorch's ``fake`` backend (collectives return at once, nothing is sent), with the collectives
that fill a buffer replaced, for CPU and CUDA tensors, by what this rank alone can give: torch 2.11's fake
backend writes only all-gathers and leaves a reduce-scatter's, an all-to-all's or a receive's output as
``torch.empty`` left it: on CUDA recycled memory, often NaN, and garbage split sizes for expert parallelism.

* all-gather: this rank's input in every slot (as the fake backend does);
* reduce-scatter: this rank's own chunk of its input;
* all-to-all: its own input back (split sizes are this rank's own, i.e. balanced routing); an output longer
  than the input repeats the input;
* receive: zeros (meshtron's CP ring and pipeline stages put their own filler in afterwards);
* scatter on a non-root rank: zeros (the root's list is not here);
* all-reduce, broadcast, reduce, gather, barrier, send: the fake backend's (nothing moves; in place is as is).

The replacements are registered on torch's ``c10d`` operators (``torch.library``), through which
``torch.distributed``'s calls, functional collectives (DTensor) and FSDP all pass, and removed when the group
is destroyed. While they are registered every CPU and CUDA collective of the process takes them: only a
rehearsal, whose every group is fake, may hold them.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist


def _work():
    """A completed Work, as the operators return (torch's own meta kernels make theirs the same way)."""
    from torch._C._distributed_c10d import FakeWork

    return FakeWork().boxed()


def _group(args) -> tuple[int, int]:
    """(rank, size) in the process group among an operator's arguments."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(arg)
            return group.rank(), group.size()
    raise RuntimeError("meshtron one-rank group: no process group among the collective's arguments")


def _fill(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out`` <- ``source`` row by row, repeated when ``out`` is longer, zeros when ``source`` is empty."""
    if out.numel() == 0:
        return
    if source.numel() == 0:
        out.zero_()
        return
    if out.shape == source.shape:
        out.copy_(source)
        return
    flat_out, flat_in = out.reshape(-1), source.reshape(-1)
    done = 0
    while done < flat_out.numel():
        n = min(flat_in.numel(), flat_out.numel() - done)
        flat_out[done : done + n].copy_(flat_in[:n])
        done += n


def _reduce_scatter_base(out, inp, *rest):
    rank, size = _group(rest)
    out.copy_(inp.reshape(-1).chunk(size)[rank].view_as(out))
    return out, _work()


def _reduce_scatter(outs, inps, *rest):
    rank, _ = _group(rest)
    for out, chunks in zip(outs, inps):
        out.copy_(chunks[rank])
    return outs, _work()


def _reduce_scatter_coalesced(outs, inps, *rest):
    rank, size = _group(rest)
    for out, inp in zip(outs, inps):
        out.copy_(inp.reshape(-1).chunk(size)[rank].view_as(out))
    return _work()


def _allgather_base(out, inp, *rest):
    _, size = _group(rest)
    for chunk in out.reshape(-1).chunk(size):
        chunk.copy_(inp.reshape(-1))
    return out, _work()


def _allgather(outs, inps, *rest):
    for slots, inp in zip(outs, inps):
        for slot in slots:
            slot.copy_(inp)
    return outs, _work()


def _allgather_coalesced(outs, inps, *rest):
    for slots in outs:
        for slot, inp in zip(slots, inps):
            slot.copy_(inp)
    return _work()


def _allgather_into_tensor_coalesced(outs, inps, *rest):
    _, size = _group(rest)
    for out, inp in zip(outs, inps):
        for chunk in out.reshape(-1).chunk(size):
            chunk.copy_(inp.reshape(-1))
    return _work()


def _alltoall_base(out, inp, *rest):
    _fill(out, inp)
    return _work()


def _alltoall(outs, inps, *rest):
    for out, inp in zip(outs, inps):
        _fill(out, inp)
    return outs, _work()


def _recv(tensors, *rest):
    for tensor in tensors:
        tensor.zero_()
    return _work()


def _scatter(outs, inps, *rest):
    rank, _ = _group(rest)
    if inps and inps[0]:  # the root: its own slot
        outs[0].copy_(inps[0][rank])
    else:
        outs[0].zero_()
    return outs, _work()


ONE_RANK_KERNELS = {
    "_reduce_scatter_base_": _reduce_scatter_base,
    "reduce_scatter_": _reduce_scatter,
    "reduce_scatter_tensor_coalesced_": _reduce_scatter_coalesced,
    "_allgather_base_": _allgather_base,
    "allgather_": _allgather,
    "allgather_coalesced_": _allgather_coalesced,
    "allgather_into_tensor_coalesced_": _allgather_into_tensor_coalesced,
    "alltoall_base_": _alltoall_base,
    "alltoall_": _alltoall,
    "recv_": _recv,
    "recv_any_source_": _recv,
    "scatter_": _scatter,
}
"""``c10d`` operator -> its one-rank kernel (arguments as the operator's schema; outputs written in place)."""


def _no_grad(kernel):
    def run(*args):
        with torch.no_grad():  # a backend writes outputs outside autograd; so do these
            return kernel(*args)

    return run


@contextmanager
def one_rank_collectives():
    """While open, CPU and CUDA collectives of this process behave as one rank alone would (module docstring)."""
    library = torch.library.Library("c10d", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for name, kernel in ONE_RANK_KERNELS.items():
                if hasattr(torch.ops.c10d, name):
                    for key in ("CPU", "CUDA"):
                        library.impl(name, _no_grad(kernel), key)
        yield
    finally:
        library._destroy()  # the previous (backend) kernels are the ones dispatched again


@contextmanager
def one_rank_group(rank: int, world_size: int):
    """Join a fake world of ``world_size`` as ``rank`` with one-rank collectives; leave it on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with one_rank_collectives():
            yield
    finally:
        dist.destroy_process_group()
