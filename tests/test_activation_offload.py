"""Activation offloading (train.activation_offload): saved tensors round-trip exactly (views of one storage share
one host copy), a run trains the same model with less kept on the device, which tensors are fetched ahead.
Parity of the layouts (FSDP, TP, CP with checkpointing, PP): *_offload in test_parity.py."""

from __future__ import annotations

import gc
import weakref

import torch
from conftest import train_llama_tiny
from torch import nn

from meshtron.config import load_config
from meshtron.train.activation_offload import ActivationOffloader, prefetch_candidates


def test_saved_tensors_come_back_equal_and_views_of_one_storage_share_a_host_copy():
    offloader = ActivationOffloader(torch.device("cpu"))
    weight = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with offloader.hooks():
        base = x * 2  # saves nothing itself; the two products below save views of its storage
        first, second = base[:2], base[2:].t()
        y = (first @ weight).sum() + (second.t() @ weight).sum() + (x.sin() * x.cos()).sum()
        storages = {t.untyped_storage().data_ptr() for t in (base, x)}
    copies = [ref() for ref in offloader._order if ref() is not None]
    assert len({c.host.data_ptr() for c in copies}) == len(copies)
    # base's storage once (both views), x's storage once (sin, cos and the product save it three times) and the
    # products sin(x), cos(x): the parameter stays where it is
    assert len(copies) == 4 and len(storages) == 2, [c.nbytes for c in copies]
    assert offloader.peak_offloaded_bytes == 4 * 4 * 8 * 4
    expected = torch.autograd.grad((2 * x[:2] @ weight).sum() + (2 * x[2:] @ weight).sum()
                                   + (x.sin() * x.cos()).sum(), (x, weight))  # fmt: skip
    got = torch.autograd.grad(y, (x, weight))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    del y, got, first, second, base, copies
    gc.collect()
    assert offloader.offloaded_bytes == 0  # autograd freed the graph: the host copies went with it


def test_a_view_saved_after_an_in_place_change_gets_its_own_copy():
    offloader = ActivationOffloader(torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)
    with offloader.hooks():
        base = x * 1
        before = base.sin()  # saves base as it is now
        base.mul_(3)  # (autograd allows it: mul by a constant saves nothing)
        after = base[1:].cos()  # saves a view of the changed storage
        y = before.sum() + after.sum()
    assert sum(ref() is not None for ref in offloader._order) == 2
    (grad,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(grad, x.detach().cos() - torch.cat([torch.zeros(1), 3 * (3 * x.detach()[1:]).sin()]))
    gc.collect()
    assert offloader.offloaded_bytes == 0  # autograd freed the graph: the host copies went with it


class _Copy:
    """A host copy as prefetch_candidates sees it."""

    def __init__(self, nbytes, used=False, fetched=None):
        self.nbytes, self.used, self.fetched = nbytes, used, fetched


def test_fetching_ahead_takes_the_copies_saved_just_before_newest_first_within_the_budget():
    copies = [_Copy(10), _Copy(10, used=True), _Copy(10), _Copy(10, fetched=object()), _Copy(10), _Copy(10)]
    order = [weakref.ref(c) for c in copies]
    # unpacking copy 5: 4 is next; 3 is already on its way (counts against the budget); 1 is used (skipped)
    assert prefetch_candidates(order, 5, 30) == [copies[4], copies[2]]
    assert prefetch_candidates(order, 5, 25) == [copies[4]]
    assert prefetch_candidates(order, 0, 100) == []
    del copies[2]  # freed: skipped, and the budget reaches copy 0
    assert prefetch_candidates(order, 5, 30) == [copies[3], copies[0]]


def test_a_run_with_offloading_trains_the_same_model_and_keeps_its_activations_off_the_device(tmp_path, cache_dir):
    results = {}
    for offload in (False, True):
        for checkpointing in ("none", "full"):
            results[offload, checkpointing] = train_llama_tiny(
                cache_dir,
                tmp_path / f"{offload}-{checkpointing}",
                f"train.activation_offload={str(offload).lower()}",
                f"train.activation_checkpointing={checkpointing}",
                steps=3,
            )
    for checkpointing in ("none", "full"):
        plain, offloaded = results[False, checkpointing], results[True, checkpointing]
        assert offloaded.losses == plain.losses and offloaded.grad_norms == plain.grad_norms  # copies: bit for bit
        # what autograd keeps moves to the host (on CPU only parameters stay: no size threshold), storage for storage
        assert offloaded.activation_bytes < 0.05 * plain.activation_bytes, (offloaded, plain)
        assert 0.9 * plain.activation_bytes <= offloaded.offloaded_bytes <= 1.1 * plain.activation_bytes
    # measured (llama-tiny, 4 x 64 tokens): 2.9 MB kept without checkpointing; with it, the blocks' inputs
    assert results[True, "full"].offloaded_bytes < 0.3 * results[True, "none"].offloaded_bytes


def test_mixed_precision_weight_copies_stay_on_the_device_and_the_planner_says_so(tmp_path, cache_dir):
    """bf16 without FSDP: the compute-dtype weight copies live through the step, so they are not offloaded (that would
    free nothing); the planner counts them on the device and the rest in host memory."""
    from meshtron.plan.memory import activation_bytes, config_view, host_activation_bytes

    results = {}
    for offload in (False, True):
        settings = ["precision.mixed_precision=bf16", f"train.activation_offload={str(offload).lower()}"]
        results[offload] = train_llama_tiny(cache_dir, tmp_path / str(offload), *settings)
    plain, offloaded = results[False], results[True]
    assert offloaded.losses == plain.losses
    # measured: 1,859,200 B kept without offloading; with it 172,672 B of weight copies stay, 1,686,528 B move
    assert offloaded.activation_bytes + offloaded.offloaded_bytes == plain.activation_bytes
    assert 0 < offloaded.activation_bytes < 0.15 * plain.activation_bytes
    cfg = load_config(str(tmp_path / "True" / "config.toml"), env={})  # the offloading run's resolved config
    shape, layout, workload = config_view(cfg, 1, device="cpu")
    on_device, on_host = activation_bytes(shape, layout, workload)[0], host_activation_bytes(shape, layout, workload)[0]
    assert abs(on_device / offloaded.activation_bytes - 1) <= 0.25, (on_device, offloaded.activation_bytes)
    assert abs(on_host / offloaded.offloaded_bytes - 1) <= 0.25, (on_host, offloaded.offloaded_bytes)


class ScriptedTransfers:
    """HostTransfers that log what the offloader asks of the streams (what CudaTransfers would do on a GPU)."""

    def __init__(self):
        self.log = []
        self.names = {}

    def name(self, tensor):
        return self.names.get(tensor.data_ptr(), "?")

    def to_host(self, source):
        host = source.clone()
        self.names[host.data_ptr()] = f"t{len(self.names)}"
        self.log.append(("to_host", self.names[host.data_ptr()]))
        return host, f"copied:{self.names[host.data_ptr()]}"

    def wait(self, event):
        self.log.append(("wait", event))

    def to_device(self, host, device):
        self.log.append(("to_device", self.name(host)))
        return host.clone()

    def to_device_ahead(self, host, device):
        self.log.append(("to_device_ahead", self.name(host)))
        return host.clone(), f"ready:{self.name(host)}"

    def adopt(self, tensor):
        self.log.append(("adopt",))


def test_backward_fetches_each_copy_once_waiting_for_its_copy_and_fetches_the_next_ones_ahead():
    """The CUDA path's order of events, scripted: a copy is waited for before it is read; fetching one starts the
    copies backward needs next (up to twice the largest), which are then waited for and adopted, never fetched
    twice."""
    transfers = ScriptedTransfers()
    offloader = ActivationOffloader(torch.device("cpu"), transfers=transfers)
    saved = [torch.full((4,), float(i)) for i in range(4)]  # t0..t3, 16 bytes each
    handles = [offloader._pack(t) for t in saved]
    assert transfers.log == [("to_host", f"t{i}") for i in range(4)]
    transfers.log.clear()
    restored = [offloader._unpack(handles[i]) for i in (3, 2, 1, 0)]  # backward: the newest first
    assert transfers.log == [
        ("wait", "copied:t3"), ("to_device", "t3"), ("to_device_ahead", "t2"), ("to_device_ahead", "t1"),
        ("wait", "ready:t2"), ("adopt",), ("to_device_ahead", "t0"),
        ("wait", "ready:t1"), ("adopt",),
        ("wait", "ready:t0"), ("adopt",),
    ]  # fmt: skip
    for value, tensor in zip((3, 2, 1, 0), restored):
        assert torch.equal(tensor, torch.full((4,), float(value)))
    transfers.log.clear()
    again = offloader._unpack(handles[2])  # a zero-bubble pipeline's second pass: the device copy is still there
    assert transfers.log == [] and torch.equal(again, saved[2])
