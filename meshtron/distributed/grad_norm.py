"""Global gradient norm over DTensor shards on any mesh, and clipping by it.

Every rank sums the squares of its local gradient pieces, each weighted by 1 / (number of ranks that
hold an identical copy of that piece), and one all-reduce over all ranks adds them up. So a
parameter sharded over (dp_shard, tp) and replicated over dp_replicate is counted exactly once, with
a single collective whatever the mesh, and none when every rank holds every gradient whole
(DDP-style replication). A parameter marked ``DUPLICATE_GRADIENT`` (a pipeline's second copy of tied
embeddings) is left out, so the tied weight counts once. ``local_grad_square_sum`` gives a rank's share
alone, for callers that reduce it together with other numbers (meshtron.train.step_stats).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from meshtron.tensors import local_tensor


def _copies(grad: torch.Tensor, ranks: int) -> int:
    """How many ranks hold the same values as this rank's local piece of ``grad``."""
    if not isinstance(grad, DTensor):
        return ranks
    mesh = grad.device_mesh
    # Any placement but Replicate splits the values (Shard, FSDP's _StridedShard, Partial).
    shards = math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if not isinstance(p, Replicate))
    return ranks // shards


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _weighted_square_sum(grads: list[torch.Tensor], ranks: int) -> torch.Tensor | None:
    """Sum of squares of the local pieces, each divided by the number of ranks holding a copy of it."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        local = local_tensor(grad)
        by_copies.setdefault(_copies(grad, ranks), []).append(local.float())
    total = None
    for copies, tensors in sorted(by_copies.items()):
        sum_sq = torch.stack(torch._foreach_norm(tensors, 2.0)).pow(2).sum()
        sum_sq = sum_sq / copies if copies > 1 else sum_sq
        total = sum_sq if total is None else total + sum_sq
    return total


DUPLICATE_GRADIENT = "_meshtron_duplicate_gradient"
"""Set (True) on a parameter whose gradient equals another parameter's, which the norm counts instead: the
last pipeline stage's copy of tied embeddings (meshtron.distributed.tied_embeddings). Clipping still scales it."""


def _grads(parameters) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None and not getattr(p, DUPLICATE_GRADIENT, False)]


def replicated_everywhere(grads: list[torch.Tensor], ranks: int, pipeline_degree: int = 1) -> bool:
    """Whether each of the ``ranks`` ranks holds every gradient whole: its local norm is then the global one."""
    return pipeline_degree == 1 and all(_copies(grad, ranks) == ranks for grad in grads)


@torch.no_grad()
def local_grad_square_sum(parameters, group=None, pipeline_degree: int = 1) -> torch.Tensor | None:
    """This rank's share of the squared global gradient norm (fp32 scalar; None without gradients):
    summed over the ranks of ``group`` it gives the square of the global norm.

    ``group`` is the set of ranks that together hold every parameter (default: all ranks);
    ``pipeline_degree`` how many pipeline ranks split the parameters among them.
    """
    return _weighted_square_sum(_grads(parameters), _group_size(group) // pipeline_degree)


@torch.no_grad()
def global_grad_norm(parameters, group=None, pipeline_degree: int = 1) -> torch.Tensor:
    """The L2 norm of all gradients as one vector, identical on every rank (fp32 scalar tensor).

    ``group`` and ``pipeline_degree`` as in ``local_grad_square_sum``.
    """
    grads = _grads(parameters)
    ranks = _group_size(group)
    if ranks > 1 and replicated_everywhere(grads, ranks, pipeline_degree):
        total = _weighted_square_sum(grads, 1)  # every rank has it all: no collective
        return torch.zeros(()) if total is None else total.sqrt()
    total = _weighted_square_sum(grads, ranks // pipeline_degree)
    if total is None:
        return torch.zeros(())
    if ranks > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_gradients(parameters, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (no-op for ``max_norm == 0``)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
