"""Expert parallelism against one process, in one torchrun launch of 4 processes (gloo).

Usage: torchrun --nproc-per-node 4 tests/expert_parallel_worker.py OUT.json
Every rank has its own tokens (a different number per rank) and the router is biased so that routing is
uneven: rank 0's tokens go mostly to the last experts, rank 3's to the first, expert 1 gets no token at
all. For a tiny Qwen3-MoE block (8 experts) and a tiny Mixtral block (4 experts), top-2, the EP block's
output and gradients (tokens, router, expert shards) are compared with the block of one process run on
the union of the tokens of the ranks concerned:

- ``ep2`` / ``ep4``: EP alone over 2 ranks (two EP groups, each compared with its own two ranks' tokens)
  and over 4 ranks; the router gradient is summed over the EP group, the expert gradient is the owner's;
- ``fsdp_ep2``: FSDP over dp_shard=4 with EP over 2 (experts sharded over efsdp=2 with the dense divide
  factor 4, everything else over the 4 ranks), loss scaled by dp as meshtron's step does: every gradient
  (full tensors) must equal the single-process gradient over all 4 ranks' tokens;
- ``fsdp_ep4``: FSDP over 4 with EP over 4 (efsdp=1); ``hsdp_ep2``: HSDP dp_replicate=2 x dp_shard=2 (experts
  over (dp_replicate, efsdp=1)); ``bf16 fsdp_ep2``: Qwen3-MoE in bf16 compute with fp32 reduction (smoke).

Rank 0 writes {check: relative error} plus the sub-mesh ranks, the dispatch splits against
``all_to_all_traffic`` and the error for an ep that does not divide the number of experts.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshtron.distributed.expert_parallel import all_to_all_traffic, apply_expert_parallel, shard_experts
from meshtron.distributed.grad_norm import global_grad_norm
from meshtron.distributed.mesh import Meshes, ParallelDims, expert_meshes
from meshtron.errors import ConfigError
from meshtron.tensors import local_tensor

WORLD = 4
HIDDEN = 16
TOKENS = [6, 9, 12, 15]
SHIFT = [3.0, 0.0, 0.5, -3.0]


def build_block(family: str):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
        )
        cls = Qwen3MoeSparseMoeBlock
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
        cls = MixtralSparseMoeBlock
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = cls(cfg)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2)
        router = block.gate.weight
        router[:, 0] = torch.linspace(-2, 2, router.shape[0])  # feature 0 is the per-rank shift
        router[1, 1] = -50.0  # feature 1 is 1 on every token: expert 1 is never chosen
    return block


def rank_data(rank: int):
    """Rank ``rank``'s tokens (T_r, H) and the cotangent of its block output: the same on every process."""
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=generator)
    x[:, 0] = SHIFT[rank]
    x[:, 1] = 1.0
    return x, torch.randn(TOKENS[rank], HIDDEN, generator=generator)


def reference(family: str, ranks: list[int]):
    """One process, the union of ``ranks``' tokens: per-rank outputs and token gradients, router and
    expert gradients."""
    block = build_block(family)
    data = [rank_data(r) for r in ranks]
    x = torch.cat([d[0] for d in data]).requires_grad_()
    out = block(x[None])[0]
    (out * torch.cat([d[1] for d in data])).sum().backward()
    sizes = [TOKENS[r] for r in ranks]
    return {
        "out": dict(zip(ranks, out.detach().split(sizes))),
        "x_grad": dict(zip(ranks, x.grad.split(sizes))),
        "router": block.gate.weight.grad,
        "gate_up_proj": block.experts.gate_up_proj.grad,
        "down_proj": block.experts.down_proj.grad,
    }


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def check_ep(family: str, ep_mesh, use_grouped_mm, checks: dict, name: str) -> None:
    """EP alone: this rank against one process over its EP group's tokens."""
    rank = dist.get_rank()
    group_ranks = ep_mesh.mesh.tolist()
    want = reference(family, group_ranks)
    block = build_block(family)
    apply_expert_parallel(block.experts, ep_mesh, use_grouped_mm=use_grouped_mm)
    x, cotangent = rank_data(rank)
    x.requires_grad_()
    out = block(x[None])[0]
    (out * cotangent).sum().backward()
    router_grad = block.gate.weight.grad.clone()
    dist.all_reduce(router_grad, group=ep_mesh.get_group())
    ep_rank = ep_mesh.get_local_rank()
    per_rank = block.experts.gate_up_proj.shape[0] // ep_mesh.size()
    rows = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    errors = {
        "out": rel(out.detach(), want["out"][rank]),
        "x_grad": rel(x.grad, want["x_grad"][rank]),
        "router_grad": rel(router_grad, want["router"]),
        "gate_up_grad": rel(local_tensor(block.experts.gate_up_proj.grad), want["gate_up_proj"][rows]),
        "down_grad": rel(local_tensor(block.experts.down_proj.grad), want["down_proj"][rows]),
        "grad_is_shard": float(
            tuple(local_tensor(block.experts.down_proj.grad).shape) != tuple(want["down_proj"][rows].shape)
        ),
    }
    for key, value in errors.items():
        checks[f"{family} {name} {key}"] = max_over_ranks(value)

    # The dispatch splits this rank used equal the traffic helper's rows for the group's routing.
    routing = []
    for r in group_ranks:
        with torch.no_grad():
            routing.append(block.gate(rank_data(r)[0])[2])
    traffic = all_to_all_traffic(routing, block.experts.num_global_experts, HIDDEN, 4)
    send, recv = block.experts.last_dispatch
    mismatch = float(
        send != traffic.rows[ep_rank] or recv != [traffic.rows[src][ep_rank] for src in range(len(routing))]
    )
    checks[f"{family} {name} dispatch splits vs traffic"] = max_over_ranks(mismatch)
    if rank == 0:
        checks[f"{family} {name} traffic"] = {
            "rows": traffic.rows,
            "sent_bytes": [traffic.sent_bytes(r) for r in range(len(routing))],
            "max_sent_bytes": traffic.max_sent_bytes(),
        }


def check_fsdp_ep(
    family: str, meshes: Meshes, dims: ParallelDims, ep: int, checks: dict, name: str, policy=None
) -> None:
    """FSDP (or HSDP) x EP with meshtron's loss convention: full gradients equal one process's."""
    rank = dist.get_rank()
    want = reference(family, list(range(WORLD)))
    sub = expert_meshes(meshes, ep)
    block = build_block(family)
    apply_expert_parallel(block.experts, sub.ep)
    dp_cp = dims.dp * dims.cp
    shard_experts(block.experts, sub.expert_fsdp, dp_cp, reshard_after_forward=True, mp_policy=policy)
    fully_shard(block, mesh=meshes.fsdp, reshard_after_forward=True, mp_policy=policy or MixedPrecisionPolicy())
    x, cotangent = rank_data(rank)
    x.requires_grad_()
    out = block(x[None])[0]
    # meshtron's step scales each rank's loss sum by dp*cp / global targets; FSDP divides by dp*cp.
    ((out * cotangent).sum() * dp_cp).backward()
    errors = {
        "out": rel(out.detach().float(), want["out"][rank]),
        "x_grad": rel(x.grad / dp_cp, want["x_grad"][rank]),
        "router_grad": rel(block.gate.weight.grad.full_tensor(), want["router"]),
        "gate_up_grad": rel(block.experts.gate_up_proj.grad.full_tensor(), want["gate_up_proj"]),
        "down_grad": rel(block.experts.down_proj.grad.full_tensor(), want["down_proj"]),
    }
    # meshtron's gradient norm (each local piece weighted by 1 / its copies) counts every expert once.
    want_norm = torch.cat([want[k].flatten() for k in ("router", "gate_up_proj", "down_proj")]).norm()
    errors["grad_norm"] = rel(global_grad_norm(block.parameters()), want_norm)
    # The region meshtron's loader and DCP compute for a shard (offset and shape over the strided
    # (efsdp, ep) placements) is the rows this rank holds.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for pname in ("gate_up_proj", "down_proj"):
        param = getattr(block.experts, pname)
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        region = tuple(slice(start, start + size) for start, size in zip(offset, shape))
        full = param.full_tensor()
        errors[f"{pname} local region"] = rel(param.to_local(), full[region]) if param.to_local().numel() else 0.0
    for key, value in errors.items():
        checks[f"{family} {name} {key}"] = max_over_ranks(value)
    if rank == 0:
        param = block.experts.gate_up_proj
        checks[f"{family} {name} expert placements"] = [str(param.device_mesh.mesh_dim_names), str(param.placements)]


def main() -> None:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks: dict = {}

    fsdp4 = ParallelDims(dp_shard=4)
    meshes = fsdp4.build_mesh("cpu")
    ep2 = expert_meshes(meshes, 2)
    ep4 = expert_meshes(meshes, 4)
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2)
    hsdp_meshes = hsdp.build_mesh("cpu")
    cp_dims = ParallelDims(dp_shard=2, cp=2)
    cp_meshes = cp_dims.build_mesh("cpu")
    cp_ep2 = expert_meshes(cp_meshes, 2)
    hsdp_ep2 = expert_meshes(hsdp_meshes, 2)

    mesh_ranks = {}
    for label, sub in (
        ("dp_shard4 ep2", ep2),
        ("dp_shard4 ep4", ep4),
        ("dp_shard2 cp2 ep2", cp_ep2),
        ("dp_replicate2 dp_shard2 ep2", hsdp_ep2),
    ):
        for key in ("ep", "efsdp", "expert_fsdp"):
            mesh_ranks[f"{label} {key}"] = getattr(sub, key).mesh.tolist()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, mesh_ranks)
    if rank == 0:
        checks["mesh ranks"] = gathered

    for family in ("qwen3_moe", "mixtral"):
        check_ep(family, ep2.ep, None, checks, "ep2")
        check_ep(family, ep4.ep, None, checks, "ep4")
        check_ep(family, ep4.ep, False, checks, "ep4 loop")
        check_fsdp_ep(family, meshes, fsdp4, 2, checks, "fsdp_ep2")
        check_fsdp_ep(family, meshes, fsdp4, 4, checks, "fsdp_ep4")
        check_fsdp_ep(family, hsdp_meshes, hsdp, 2, checks, "hsdp_ep2")
    # bf16 compute, fp32 reduction and master weights: a smoke test of the dtypes (rounding-level errors).
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_fsdp_ep("qwen3_moe", meshes, fsdp4, 2, checks, "bf16 fsdp_ep2", policy=bf16)

    # An ep that does not divide the number of experts (Mixtral has 4; 3 does not divide them either
    # way, so build a 6-expert Qwen block for ep=4).
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2)
    try:
        apply_expert_parallel(Qwen3MoeExperts(cfg), ep4.ep)
        checks["indivisible error"] = None
    except ConfigError as err:
        checks["indivisible error"] = str(err)
    try:
        expert_meshes(cp_meshes, 3)
        checks["ep not dividing dp_shard*cp"] = None
    except ConfigError as err:
        checks["ep not dividing dp_shard*cp"] = str(err)

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(checks, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
