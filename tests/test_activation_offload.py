"""Activation offloading (train.activation_offload): saved tensors round-trip exactly (views of one storage share
one host copy), a run trains the same model with less kept on the device, which tensors are fetched ahead.
Parity of the layouts (FSDP, TP, CP with checkpointing, PP): *_offload in test_parity.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import train_llama_tiny
from torch import nn

from meshtron.config import load_config
from meshtron.distributed.activation_memory.offload import (
    ActivationOffloader,
    HostTransfers,
    PinnedPieces,
    prefetch_candidates,
)


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

    def __init__(self, nbytes, used=False, fetched=None, forward_call=0):
        self.nbytes, self.used, self.fetched, self.forward_call = nbytes, used, fetched, forward_call


def test_fetching_ahead_takes_the_copies_saved_just_before_newest_first_within_the_budget():
    copies = [_Copy(10), _Copy(10, used=True), _Copy(10), _Copy(10, fetched=object()), _Copy(10), _Copy(10)]
    order = [weakref.ref(c) for c in copies]
    # unpacking copy 5: 4 is next; 3 is already on its way (counts against the budget); 1 is used (skipped)
    assert prefetch_candidates(order, 5, 30) == [copies[4], copies[2]]
    assert prefetch_candidates(order, 5, 25) == [copies[4]]
    assert prefetch_candidates(order, 0, 100) == []
    del copies[2]  # freed: skipped, and the budget reaches copy 0
    assert prefetch_candidates(order, 5, 30) == [copies[3], copies[0]]
    calls = [_Copy(10, forward_call=1), _Copy(10, forward_call=2), _Copy(10, forward_call=2)]
    order = [weakref.ref(c) for c in calls]
    assert prefetch_candidates(order, 2, 100) == [calls[1]]  # never another forward call's


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


def _tiled_block(tiles: int) -> nn.Module:
    """A block whose MLP runs over ``tiles`` tiles of its tokens (meshtron.distributed.activation_memory.tiled_mlp)."""
    from meshtron.distributed.activation_memory.tiled_mlp import apply_tiled_mlp

    block = nn.Module()
    block.mlp = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8))
    apply_tiled_mlp([("0", block)], lambda _: {"mlp": "mlp"}, tiles)
    return block


def test_a_tiled_mlp_recomputed_in_backward_copies_nothing_to_the_host():
    """The hooks stay active in backward, where each tile's recomputation saves tensors of its own: those stay on the
    device (they live for one tile), and the one saved input is fetched once, not once per tile."""
    transfers = ScriptedTransfers()
    offloader = ActivationOffloader(torch.device("cpu"), transfers=transfers)
    block = _tiled_block(tiles=4)
    x = torch.randn(2, 16, 8, requires_grad=True)
    with offloader.hooks():
        loss = block.mlp(x * 1).pow(2).sum()
        forward = [event for event in transfers.log if event[0] == "to_host"]
        transfers.log.clear()
        loss.backward()
    assert forward == [("to_host", "t0"), ("to_host", "t1")]  # the tiled function's input, pow's input
    assert [event for event in transfers.log if event[0] == "to_host"] == []
    assert sorted(event for event in transfers.log if event[0].startswith("to_device")) == [
        ("to_device", "t1"), ("to_device_ahead", "t0")
    ]  # fmt: skip
    plain = x.detach().requires_grad_(True)
    block.mlp(plain * 1).pow(2).sum().backward()
    assert torch.equal(x.grad, plain.grad)


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo process group in this process and its mesh, destroyed after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_compiled_tensor_parallel_block_keeps_its_weights_on_the_device(one_rank_mesh):
    """Compiled code saves a DTensor weight's local tensor, neither a Parameter nor a view of one: recognized by its
    storage, it is neither copied to the host nor counted as an activation. (aot_eager: the same AOTAutograd unwrapping
    as inductor, without compiling kernels.)"""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from meshtron.distributed.activation_memory.measure import ResidentStorages, SavedActivationTracker

    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    parallelize_module(mlp, one_rank_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = torch.compile(mlp, backend="aot_eager")
    resident = ResidentStorages(mlp)
    tracker = SavedActivationTracker(resident)
    offloader = ActivationOffloader(torch.device("cpu"), tracker, resident=resident)
    x = torch.randn(4, 8, requires_grad=True)
    with offloader.hooks():
        loss = compiled(x).pow(2).sum()
    weights = {p._local_tensor.untyped_storage().data_ptr() for p in mlp.parameters()}
    copied = [ref() for ref in offloader._order if ref() is not None]
    assert copied and not weights & set(offloader._copies), [c.nbytes for c in copied]
    # what is offloaded: the input, tanh's output, the MLP's output (pow's input); 8 x 16 + 16 x 8 weights stay
    assert sorted(c.nbytes for c in copied) == sorted([4 * 8 * 4, 4 * 16 * 4, 4 * 8 * 4]), [c.nbytes for c in copied]
    assert tracker.peak_bytes == 0  # nothing else was kept on the device: the weights are not activations
    loss.backward()
    assert all(p.grad is not None for p in mlp.parameters())


class AheadTracking(ScriptedTransfers):
    """ScriptedTransfers that also count the bytes fetched ahead and not yet used (waited for), at their most."""

    def __init__(self):
        super().__init__()
        self.ahead, self.most_ahead = {}, 0

    def to_device_ahead(self, host, device):
        self.ahead[self.name(host)] = host.nbytes
        self.most_ahead = max(self.most_ahead, sum(self.ahead.values()))
        return super().to_device_ahead(host, device)

    def wait(self, event):
        if event.startswith("ready:"):
            self.ahead.pop(event.removeprefix("ready:"))
        super().wait(event)


def test_fetching_ahead_never_crosses_into_another_stage_or_micro_batch():
    """Rank 0 of a zero-bubble (V) pipeline over 2 ranks holds stages 0 and 3: forwards of stage 0 for micro-batches
    0 and 1, then stage 3's of micro-batch 0, whose backward comes first. The tensors saved just before stage 3's are
    micro-batch 1's of stage 0, needed last: fetched ahead then, they would wait on the device beyond the budget
    (twice the largest copy) while stage 0's micro-batch 0 fetches its own."""
    transfers = AheadTracking()
    offloader = ActivationOffloader(torch.device("cpu"), transfers=transfers)
    stage0, stage3 = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Tanh()  # 2 copies a call, then 1
    inputs = [torch.randn(2, 4, requires_grad=True) for _ in range(3)]
    with offloader.hooks(), offloader.forward_calls([stage0, stage3]):
        outputs = [stage0(inputs[0]), stage0(inputs[1]), stage3(inputs[2])]
        for index in (2, 0, 1):  # stage 3's micro-batch 0, then stage 0's micro-batches 0 and 1
            outputs[index].sum().backward()
    assert len(transfers.ahead) == 0 and transfers.log.count(("to_device_ahead", "t0")) == 1
    assert 0 < transfers.most_ahead <= 2 * 2 * 4 * 4, transfers.log
    stages = (stage0, stage0, stage3)
    expected = [torch.autograd.grad(stage(x).sum(), x)[0] for stage, x in zip(stages, inputs)]
    for x, grad in zip(inputs, expected):
        torch.testing.assert_close(x.grad, grad, rtol=0, atol=0)


def test_a_host_copy_is_pinned_in_pieces_the_host_allocator_does_not_round_up():
    """torch's caching host allocator rounds each pinned request up to a power of two (CachingHostAllocator.h): a
    3.59 GB block input in one request takes 4 GiB. In pieces, it takes its bytes rounded up to a MiB."""
    from meshtron.distributed.activation_memory.offload import PINNED_TAIL_BYTES, pinned_bytes, pinned_piece_sizes

    nbytes = 438_272 * 4096 * 2  # llama-8b's block input at 438,272 tokens, bf16
    pieces = pinned_piece_sizes(nbytes)
    assert all(size & (size - 1) == 0 for size in pieces)
    assert nbytes <= sum(pieces) == pinned_bytes(nbytes) < nbytes + PINNED_TAIL_BYTES
    assert pinned_piece_sizes(0) == [] and pinned_piece_sizes(1) == [PINNED_TAIL_BYTES]


class PinnedRecording(HostTransfers):
    """The host copies as CudaTransfers makes them (PinnedPieces), on plain memory: each pinned request recorded with
    what torch's caching host allocator would hold for it (rounded up to a power of two), live and at most."""

    def __init__(self):
        self.requests, self.live, self.most = [], 0, 0
        PinnedRecording.made.append(self)

    made: list = []

    def _pin(self, size):
        held = 1 << (size - 1).bit_length()
        self.requests.append(size)
        self.live += held
        self.most = max(self.most, self.live)
        piece = torch.empty(size, dtype=torch.uint8)
        weakref.finalize(piece, self._unpin, held)
        return piece

    def _unpin(self, held):
        self.live -= held

    def to_host(self, source):
        host = PinnedPieces(source.numel(), pin=self._pin)
        host.copy_from(source)
        return host, None

    def to_device(self, host, device):
        return host.to(device)


def test_the_planner_counts_the_pinned_bytes_of_the_host_copies(tmp_path, cache_dir, monkeypatch):
    """A run whose host copies are pinned as on CUDA (pieces scaled down to llama-tiny's tensors, 1 to 160 KB: 64 KiB
    and 4 KiB) trains the same model; the planner's host bytes cover what the host allocator would hold at most."""
    from meshtron.distributed.activation_memory import offload as activation_offload
    from meshtron.plan.memory import config_view, host_activation_bytes, offload_pinning_bytes

    monkeypatch.setattr(activation_offload, "PINNED_PIECE_BYTES", 1 << 16)
    monkeypatch.setattr(activation_offload, "PINNED_TAIL_BYTES", 1 << 12)
    monkeypatch.setattr(activation_offload, "HostTransfers", PinnedRecording)
    PinnedRecording.made.clear()
    run = train_llama_tiny(cache_dir, tmp_path / "run", "train.activation_offload=true", steps=1)
    requests = [size for made in PinnedRecording.made for size in made.requests]
    assert requests and all(size in (1 << 16, 1 << 12) for size in requests)
    most = max(made.most for made in PinnedRecording.made)
    cfg = load_config(str(tmp_path / "run" / "config.toml"), env={})
    shape, layout, workload = config_view(cfg, 1, device="cpu")
    planned = host_activation_bytes(shape, layout, workload)[0] + offload_pinning_bytes(shape, layout, workload)[0]
    print(f"offloaded {run.offloaded_bytes:,} B, pinned {most:,} B at most, planned {planned:,.0f} B")
    assert run.offloaded_bytes < most <= planned < 1.5 * most, (run.offloaded_bytes, most, planned)
    monkeypatch.undo()
    assert run.losses == train_llama_tiny(cache_dir, tmp_path / "plain", steps=1).losses
