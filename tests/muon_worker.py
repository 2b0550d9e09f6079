"""Four-rank checks of Muon's owner exchange (meshtron.train.optim.muon.orthogonalized), in one torchrun launch (gloo).

Usage: torchrun --nproc-per-node 4 tests/muon_worker.py OUT.json
Updates split as FSDP, TP, FSDP x TP (row- and column-wise, FSDP's _StridedShard), HSDP, EP x TP and expert-only
split, plus a plain tensor, are orthogonalized in float32 and bf16. Rank 0 writes, per case and dtype: the largest
difference from one process's Newton-Schulz of the whole matrix, the matrices each rank orthogonalized, the dtypes
the all-to-alls carried and the collectives seen; and a Muon step of FSDP x TP parameters against one process.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

from meshtron.train.optim import muon


def cases(flat, grid):
    """name -> (mesh, placements, global shape, count): ``count`` updates split alike."""
    return {
        "fsdp": (flat, (Shard(0),), (10, 6), 5),  # 3 3 3 1 rows; a full batch of 4 owners, then one more
        "fsdp_cols": (flat, (Shard(1),), (5, 7), 2),
        "fsdp_tp_rowwise": (grid, (Shard(0), Shard(1)), (6, 10), 3),
        "fsdp_tp_colwise": (grid, (_StridedShard(0, split_factor=2), Shard(0)), (10, 6), 4),
        "hsdp": (grid, (Replicate(), Shard(0)), (9, 5), 3),
        "tp": (grid, (Replicate(), Shard(1)), (6, 12), 3),
        "ep_tp": (grid, (Shard(0), Shard(2)), (4, 6, 10), 2),
        "ep_only": (grid, (Shard(0), Replicate()), (4, 6, 10), 1),
        "partial": (flat, (Partial(),), (6, 8), 2),  # not a gradient's layout: gathered whole by every rank
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    calls, carried = [], []
    original_ns, original_a2a = muon.newton_schulz, dist.all_to_all_single

    def counting_ns(matrix, steps, dtype=torch.float32, eps=1e-7):
        calls.append(matrix[..., 0, 0].numel())  # matrices in this call
        return original_ns(matrix, steps, dtype, eps)

    def recording_a2a(output, input, *args, **kwargs):
        carried.append(str(input.dtype))
        return original_a2a(output, input, *args, **kwargs)

    muon.newton_schulz, dist.all_to_all_single = counting_ns, recording_a2a
    results = {}
    generator = torch.Generator().manual_seed(0)
    for name, (mesh, placements, shape, count) in cases(flat, grid).items():
        wholes = [torch.randn(shape, generator=generator) for _ in range(count)]
        if placements == (Partial(),):  # each rank a quarter of the sum
            updates = [DTensor.from_local(w / 4, mesh, placements) for w in wholes]
        else:
            updates = [distribute_tensor(w, mesh, placements, src_data_rank=None) for w in wholes]
        for dtype in (torch.float32, torch.bfloat16):
            calls.clear(), carried.clear()
            with CommDebugMode() as comms:
                out = dict(muon.orthogonalized(updates, lambda u: u, 5, dtype))
            collectives = sorted(str(op) for op in comms.get_comm_counts())
            diffs = []
            for whole, update in zip(wholes, updates):
                got = out[update]
                assert got.placements == update.placements and got.to_local().shape == update.to_local().shape
                expected = original_ns(whole, 5, dtype).float()
                diffs.append((got.full_tensor() - expected).abs().max().item())
            per_rank = [None] * 4
            dist.all_gather_object(per_rank, sum(calls))
            results[f"{name}/{dtype}"] = {
                "diff": max(diffs),
                "updates": count,
                "local_matrices": updates[0].to_local()[..., 0, 0].numel(),
                "matrices_per_rank": per_rank,
                "carried": sorted(set(carried)),
                "collectives": collectives,
            }
    muon.newton_schulz, dist.all_to_all_single = original_ns, original_a2a
    results["step"] = muon_step_difference(grid)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def muon_step_difference(grid) -> float:
    """One MuonAdamW step of FSDP x TP parameters (column- and row-wise) against the same step in one process."""
    generator = torch.Generator().manual_seed(1)
    wholes = [torch.randn(10, 6, generator=generator), torch.randn(6, 10, generator=generator)]
    grads = [torch.randn(w.shape, generator=generator) for w in wholes]
    layouts = [(_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), Shard(1))]
    sharded, single = [], []
    for whole, grad, placements in zip(wholes, grads, layouts):
        param = nn.Parameter(distribute_tensor(whole, grid, placements, src_data_rank=None))
        param.grad = distribute_tensor(grad, grid, placements, src_data_rank=None)
        sharded.append(param)
        reference = nn.Parameter(whole.clone())
        reference.grad = grad.clone()
        single.append(reference)
    for params in (sharded, single):
        optimizer = muon.MuonAdamW(params, [], momentum=0.9, ns_steps=5, lr=0.02, weight_decay=0.1)
        optimizer.step()
        optimizer.step()
    return max(
        (p.full_tensor() if isinstance(p, DTensor) else p).sub(r).abs().max().item() for p, r in zip(sharded, single)
    )


if __name__ == "__main__":
    main()
