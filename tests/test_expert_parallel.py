"""Expert parallelism: the local dispatch / grouped GEMM / combine math against transformers' experts
(one process), a deterministic combine and dispatch backward, one host sync per EP forward (one in-process gloo
rank), the all-to-all traffic helper, and EP over 2 and 4 gloo ranks, alone and under FSDP / HSDP, against one
process (tests/expert_parallel_worker.py, one torchrun launch)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import failure_report, run_forked

from meshtron.distributed.expert_parallel import all_to_all_traffic
from meshtron.models.experts import combine, local_experts_forward, pair_rows, sort_by_expert

TOLERANCE = 1e-6


def tiny_block(family: str, implementation: str = "eager"):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(
            hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
        )
        cls = Qwen3MoeSparseMoeBlock
    elif family == "gpt_oss":  # transposed, interleaved experts with biases, a clamped SwiGLU; a router with a bias
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        cfg = GptOssConfig(
            hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.5
        )
        cls = GptOssMLP
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
        cls = MixtralSparseMoeBlock
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    block = cls(cfg)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
    return block


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max() / want.detach().abs().max())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_local_dispatch_matches_transformers_experts(family, implementation, use_grouped_mm):
    """gpt-oss (its own experts loop, no implementation switch): a swiglu_limit of 0.5 so that the clamps bind."""
    if family == "gpt_oss" and implementation == "grouped_mm":
        pytest.skip("gpt-oss's experts have one (eager) implementation")
    block = tiny_block(family, implementation)
    experts = block.experts
    hidden = torch.randn(13, 16, requires_grad=True)
    with torch.no_grad():
        _, weights, index = (block.router if family == "gpt_oss" else block.gate)(hidden)
    index[index == 2] = 0  # expert 2 gets no token: an empty group, a zero gradient
    weights.requires_grad_()
    cotangent = torch.randn(13, 16)
    names = ["gate_up_proj", "down_proj"] + (["gate_up_proj_bias", "down_proj_bias"] if family == "gpt_oss" else [])
    params = [hidden, weights, *(getattr(experts, name) for name in names)]

    want = experts(hidden, index, weights)
    want_grads = torch.autograd.grad((want * cotangent).sum(), params)
    got = local_experts_forward(experts, hidden, index, weights, use_grouped_mm=use_grouped_mm)
    got_grads = torch.autograd.grad((got * cotangent).sum(), params)

    assert relative(got, want) < TOLERANCE
    for name, g, w in zip(["hidden", "weights", *names], got_grads, want_grads):
        assert relative(g, w) < TOLERANCE, name
    assert all(g[2].abs().max() == 0 for g in got_grads[2:])
    if family == "gpt_oss":  # the clamps bind
        h = hidden.detach() @ experts.gate_up_proj[0].detach() + experts.gate_up_proj_bias[0].detach()
        assert (h[:, ::2] > 0.5).any() and (h[:, 1::2].abs() > 0.5).any()


def test_sort_by_expert_is_stable_and_counts():
    index = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, token, counts = sort_by_expert(index, 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]
    assert token.tolist() == [0, 1, 1, 2, 0, 2]
    assert counts.tolist() == [2, 2, 2, 0]


def test_combine_sums_each_tokens_slots_in_a_fixed_order_whatever_the_dispatch_order():
    """k = 4 experts per token: the combined output is bitwise the plain reference sum over each token's slots, for
    the expert-sorted order and for shuffled orders alike (``index_add`` added a token's outputs in the order its
    pairs came: rounding that moved with the order, and on a GPU with the atomics' timing); the gradients too."""
    tokens, k, hidden = 11, 4, 6
    generator = torch.Generator().manual_seed(0)
    pairs = torch.randn(tokens * k, hidden, generator=generator, requires_grad=True)  # output of pair (t, j)
    weights = torch.rand(tokens, k, generator=generator, requires_grad=True)
    cotangent = torch.randn(tokens, hidden, generator=generator)
    want = (pairs.view(tokens, k, hidden) * weights.unsqueeze(-1)).sum(dim=1)
    want_grads = torch.autograd.grad((want * cotangent).sum(), (pairs, weights))
    index = torch.randint(0, 8, (tokens, k), generator=generator)
    orders = [sort_by_expert(index, 8)[0]] + [torch.randperm(tokens * k, generator=generator) for _ in range(3)]
    for order in orders:
        got = combine(pairs[order], order, weights, torch.float32)
        assert torch.equal(got, want)
        got_grads = torch.autograd.grad((got * cotangent).sum(), (pairs, weights))
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_dispatch_and_combine_accumulate_nothing():
    """Forward and backward of the local experts (dispatch, grouped GEMMs or loop, combine) run no accumulating
    scatter (``index_add``, ``scatter_add``, ``index_put(accumulate=True)``): on a GPU those add colliding rows with
    atomics, in an order that varies, so two tensor-parallel ranks computing one replicated block would differ."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Accumulations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__
            accumulate = kwargs.get("accumulate", args[3] if "index_put" in name and len(args) > 3 else False)
            if name.startswith(("index_add", "scatter_add", "scatter_reduce", "put")) or (
                "index_put" in name and accumulate
            ):
                self.found.append(name)
            return func(*args, **kwargs)

    block = tiny_block("qwen3_moe")
    hidden = torch.randn(13, 16, requires_grad=True)
    for use_grouped_mm in (True, False):
        _, weights, index = block.gate(hidden)
        with Accumulations() as mode:
            out = local_experts_forward(block.experts, hidden, index, weights, use_grouped_mm=use_grouped_mm)
            out.square().sum().backward()
        assert not mode.found, (use_grouped_mm, mode.found)


def test_pair_rows_backward_sums_each_tokens_slots():
    """The dispatch's backward (each token's row taken once per slot) sums the k slots' gradients per token."""
    index = torch.tensor([[2, 0, 1], [0, 1, 2]])
    order, token, _ = sort_by_expert(index, 3)
    hidden = torch.randn(2, 4, requires_grad=True)
    rows = pair_rows(hidden, order, token, 3)
    assert torch.equal(rows, hidden[token])
    grad = torch.randn(6, 4)
    (got,) = torch.autograd.grad(rows, hidden, grad)
    (want,) = torch.autograd.grad(hidden[token], hidden, grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    none = torch.zeros(0, 4, requires_grad=True)  # a rank without tokens
    order, token, _ = sort_by_expert(torch.zeros(0, 3, dtype=torch.long), 3)
    assert torch.autograd.grad(pair_rows(none, order, token, 3).sum(), none)[0].shape == (0, 4)


@pytest.fixture
def one_rank_ep():
    """A 1-rank gloo group (in this process) and its 1-D ``ep`` mesh: the EP forward's own code, exchange included."""
    import torch.distributed as dist
    from conftest import free_port
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_an_expert_parallel_forward_syncs_with_the_host_once(one_rank_ep, monkeypatch, use_grouped_mm):
    """One host sync per EP MoE forward: the ``tolist`` of every split size (counted: ``tolist``, and the ops that
    read a GPU tensor on the host: ``item``, ``bincount``, ``nonzero``, ``repeat_interleave`` without
    ``output_size``, ...). It was 4 on a GPU: two ``tolist``, an unsized ``repeat_interleave``, ``bincount``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtron.distributed.expert_parallel import apply_expert_parallel

    syncs = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: syncs.append("tolist") or tolist(self))
    host_reads = ("_local_scalar_dense", "bincount", "nonzero", "masked_select", "unique", "_unique")

    class HostSyncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__
            unsized = name.startswith("repeat_interleave") and kwargs.get("output_size") is None
            if name.split(".")[0] in host_reads or name.startswith("_unique") or unsized:
                syncs.append(name)
            return func(*args, **kwargs)

    block = tiny_block("qwen3_moe")
    hidden = torch.randn(13, 16)
    with torch.no_grad():
        _, weights, index = block.gate(hidden)
        want = local_experts_forward(block.experts, hidden, index, weights)
    apply_expert_parallel(block.experts, one_rank_ep, use_grouped_mm=use_grouped_mm)
    with torch.no_grad(), HostSyncs():
        got = block.experts(hidden, index, weights)
    assert syncs == ["tolist"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_expert_parallel_exchange_is_left_out_of_compilation(one_rank_ep):
    """Under ``torch.compile`` (dynamo, eager backend) a function calling EP experts compiles once and is not
    recompiled for another routing: the exchange, whose split sizes are host integers, runs eagerly."""
    import torch._dynamo

    from meshtron.distributed.expert_parallel import apply_expert_parallel

    block = tiny_block("qwen3_moe")
    apply_expert_parallel(block.experts, one_rank_ep)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, i, w: block.experts(h, i, w) * 2, backend="eager", fullgraph=False)
    hidden = torch.randn(13, 16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):  # a different routing, hence other split sizes, each time
            index = torch.randint(0, 8, (13, 2), generator=generator)
            weights = torch.rand(13, 2, generator=generator)
            torch.testing.assert_close(compiled(hidden, index, weights), 2 * block.experts(hidden, index, weights))
    torch._dynamo.reset()


def test_all_to_all_traffic():
    # ep 2, 4 experts (2 per rank); rank 0 routes 3 pairs to rank 1, rank 1 routes 1 pair to rank 0
    routing = [torch.tensor([[0, 2], [3, 1], [2, 0]]), torch.tensor([[3, 1], [2, 3]])]
    traffic = all_to_all_traffic(routing, num_experts=4, hidden_size=8, element_size=2)
    assert traffic.rows == [[3, 3], [1, 3]]
    # rank 0 sends 3 dispatched rows and 1 combined row back; backward doubles it
    assert traffic.sent_bytes(0, backward=False) == (3 + 1) * 16
    assert traffic.sent_bytes(0) == 2 * (3 + 1) * 16
    assert traffic.sent_bytes(1) == traffic.sent_bytes(0)  # dispatch and combine mirror each other
    assert traffic.max_sent_bytes() == 128
    with pytest.raises(Exception, match="parallel.ep=2 must divide the number of experts"):
        all_to_all_traffic(routing, num_experts=3, hidden_size=8, element_size=2)


def test_expert_parallel_matches_one_process_on_4_ranks(tmp_path):
    out = tmp_path / "ep.json"
    proc = run_forked(4, ["tests/expert_parallel_worker.py", str(out)], timeout=600)
    assert proc.returncode == 0, failure_report(proc)
    checks = json.loads(out.read_text())

    errors = {name: value for name, value in checks.items() if isinstance(value, float)}
    layouts = ["ep2", "ep4", "ep4 loop", "fsdp_ep2", "fsdp_ep4", "hsdp_ep2"]
    for family in ("qwen3_moe", "mixtral"):
        for layout in layouts:
            for quantity in ("out", "x_grad", "router_grad", "gate_up_grad", "down_grad"):
                assert f"{family} {layout} {quantity}" in errors
    bad = {name: value for name, value in errors.items() if value > (3e-2 if "bf16" in name else TOLERANCE)}
    assert not bad, bad
    assert sum("bf16" in name for name in errors) == 8  # bf16 compute, fp32 reduce: rounding-level errors

    # routing is uneven: some rank sends nothing to some rank; the splits match the traffic helper
    rows = checks["qwen3_moe ep4 traffic"]["rows"]
    assert any(n == 0 for row in rows for n in row)
    assert checks["mixtral ep4 traffic"]["rows"] and all(row[1] == 0 for row in checks["mixtral ep4 traffic"]["rows"])

    meshes = checks["mesh ranks"]
    assert [m["dp_shard4 ep2 ep"] for m in meshes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [m["dp_shard4 ep2 efsdp"] for m in meshes] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [m["dp_shard4 ep4 efsdp"] for m in meshes] == [[0], [1], [2], [3]]
    assert [m["dp_shard2 cp2 ep2 ep"] for m in meshes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [m["dp_replicate2 dp_shard2 ep2 expert_fsdp"] for m in meshes] == [
        [[0], [2]],
        [[1], [3]],
        [[0], [2]],
        [[1], [3]],
    ]
    assert checks["qwen3_moe hsdp_ep2 expert placements"][0] == "('dp_replicate', 'efsdp', 'ep')"

    assert "parallel.ep=4" in checks["indivisible error"] and "num_experts=6" in checks["indivisible error"]
    assert "parallel.ep=3" in checks["ep not dividing dp_shard*cp"]
