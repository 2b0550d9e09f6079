"""Global gradient norm over DTensor shards on any mesh, and clipping by it.

Every rank sums the squares of its local gradient pieces, each weighted by 1 / (number of ranks that
hold an identical copy of that piece), and one all-reduce over all ranks adds them up. So a
parameter sharded over (dp_shard, tp) and replicated over dp_replicate is counted exactly once, with
a single collective whatever the mesh.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _copies(grad: torch.Tensor, ranks: int) -> int:
    """How many ranks hold the same values as this rank's local piece of ``grad``."""
    if not isinstance(grad, DTensor):
        return ranks
    mesh = grad.device_mesh
    # Any placement but Replicate splits the values (Shard, FSDP's _StridedShard, Partial).
    shards = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if not isinstance(p, Replicate))
    return ranks // shards


@torch.no_grad()
def global_grad_norm(parameters, group=None, pipeline_degree: int = 1) -> torch.Tensor:
    """The L2 norm of all gradients as one vector, identical on every rank (fp32 scalar tensor).

    ``group`` is the set of ranks that together hold every parameter (default: all ranks);
    ``pipeline_degree`` how many pipeline ranks split the parameters among them.
    """
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size(group) if distributed else 1
    ranks_per_stage = world_size // pipeline_degree
    by_copies: dict[int, list[torch.Tensor]] = {}
    device = None
    for param in parameters:
        if param.grad is None:
            continue
        grad = param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        by_copies.setdefault(_copies(grad, ranks_per_stage), []).append(local.float())
        device = local.device
    if device is None:
        return torch.zeros(())
    total = torch.zeros((), device=device)
    for copies, tensors in sorted(by_copies.items()):
        sum_sq = torch.stack(torch._foreach_norm(tensors, 2.0)).pow(2).sum()
        total += sum_sq / copies
    if distributed and world_size > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_gradients(parameters, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (no-op for ``max_norm == 0``)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
