"""Global gradient norm over DTensor shards on any mesh, and clipping by it.

Each gradient contributes the sum of squares of its local shard. Gradients are grouped by the mesh
dimensions over which they are split (Shard placements); each group is reduced with one all-reduce
over those dimensions together, so replicated copies are never counted twice.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def _local_and_split_dims(grad: torch.Tensor):
    if not isinstance(grad, DTensor):
        return grad, None, ()
    split = tuple(i for i, p in enumerate(grad.placements) if isinstance(p, (Shard, Partial)))
    return grad.to_local(), grad.device_mesh, split


@torch.no_grad()
def global_grad_norm(parameters) -> torch.Tensor:
    """The L2 norm of all gradients as one vector, identical on every rank (fp32 scalar tensor)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for param in parameters:
        if param.grad is None:
            continue
        local, mesh, split = _local_and_split_dims(param.grad)
        key = (id(mesh), split)
        groups[key].append((local, mesh, split))
    total = None
    for entries in groups.values():
        locals_ = [entry[0] for entry in entries]
        mesh, split = entries[0][1], entries[0][2]
        norms = torch._foreach_norm([t.float() for t in locals_], 2.0)
        sum_sq = torch.stack(norms).pow(2).sum()
        if mesh is not None and split:
            placements = [Partial() if i in split else Replicate() for i in range(mesh.ndim)]
            sum_sq = DTensor.from_local(sum_sq, mesh, placements).full_tensor()
        total = sum_sq if total is None else total + sum_sq.to(total.device)
    if total is None:
        return torch.zeros(())
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
