"""Expert parallelism: the local dispatch / grouped GEMM / combine math against transformers' experts
(one process), the all-to-all traffic helper, and EP over 2 and 4 gloo ranks, alone and under FSDP /
HSDP, against one process (tests/expert_parallel_worker.py, one torchrun launch)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import failure_report, run_torchrun

from meshtron.distributed.expert_parallel import all_to_all_traffic
from meshtron.models.experts import local_experts_forward, sort_by_expert

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
    proc = run_torchrun(4, ["tests/expert_parallel_worker.py", str(out)], timeout=600)
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
