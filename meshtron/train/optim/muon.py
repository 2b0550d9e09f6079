"""Muon for the decoder blocks' matrices, AdamW for everything else (``optimizer.name=muon``).

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is scalable for LLM training") keeps one momentum buffer per matrix
and steps along its orthogonalized direction: five Newton-Schulz iterations turn the (Nesterov) momentum ``M`` into
roughly ``U V^T`` of its singular value decomposition. The step is scaled by ``0.2 * sqrt(max(rows, cols))`` so that
its RMS matches AdamW's, as Moonshot's recipe does, so one ``optimizer.lr`` serves both, and weight decay is decoupled
(``p *= 1 - lr * weight_decay``). Muon takes the 2-D weights of the decoder blocks and, per expert, the 3-D expert
weights of MoE blocks; AdamW takes the embeddings, the head, norms, biases and the MoE routers, as the Muon papers do.

The orthogonalization needs whole matrices. A parameter sharded by FSDP (rows) or tensor parallelism (rows or
columns) has each of its matrices orthogonalized by one owner among the ranks that split it (balanced by work):
every rank sends its shards, cast to the Newton-Schulz dtype, to the owners with one all-to-all per splitting mesh
dim, and the owners send each rank its shard of the result the same way (``orthogonalized``), so every layout
computes the one-process update. Expert weights sharded only along the expert dimension (expert parallelism, FSDP
over experts) and plain tensors (DDP, one process) hold whole matrices and are orthogonalized where they are.
The momentum buffers are sharded like their parameters: checkpoints save and reshard them as they do AdamW's moments.
Newton-Schulz runs in bf16 under bf16 mixed precision, in float32 otherwise. See docs/optimizers.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtron.config import OptimizerConfig
from meshtron.errors import ConfigError
from meshtron.tensors import dtensor_like
from meshtron.train.optim.adamw import adamw_arguments, adamw_groups

# Keller Jordan's quintic coefficients: fast convergence of the singular values towards ~1 (not exactly 1).
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2
"""The update of an (A, B) matrix is scaled by RMS_MATCH * sqrt(max(A, B)): an RMS near AdamW's (Moonshot)."""


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32, eps: float = 1e-7):
    """Approximately orthogonalize the last two dims of ``matrix`` (batched over the others), computing in ``dtype``
    (bf16 under bf16 mixed precision, as Muon's authors do; float32 otherwise)."""
    x = matrix.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


def _chunk_sizes(extent: int, parts: int) -> list[int]:
    """The sizes ``torch.chunk`` (and DTensor's ``Shard``, and FSDP) cuts ``extent`` into over ``parts`` ranks."""
    chunk = -(-extent // parts)
    return [max(0, min(chunk, extent - rank * chunk)) for rank in range(parts)]


@dataclass(frozen=True)
class _Stage:
    """One hop of the exchange: mesh dim ``mesh_dim`` splits tensor dim ``tensor_dim``, whose extent there (before the
    split) is ``extent``; ``axis``: the batch axis that gathers over this mesh dim."""

    mesh_dim: int
    tensor_dim: int
    extent: int
    axis: int


@dataclass(frozen=True)
class _Exchange:
    """How the whole matrices of parameters sharded alike reach their owners: ``stages`` innermost split first."""

    mesh: DeviceMesh
    mesh_dims: tuple[int, ...]
    """The mesh dims that split the matrices (the owners: the ranks along them), in mesh order."""
    sizes: tuple[int, ...]
    """Ranks along each gathering mesh dim (the batch axes, in mesh order)."""
    stages: tuple[_Stage, ...]
    slot: int
    """This rank's place among the ``prod(sizes)`` owners (its coordinates on the gathering mesh dims)."""

    @property
    def owners(self) -> int:
        return math.prod(self.sizes)


def _nesting(tensor: DTensor, dim: int) -> list[int] | None:
    """The mesh dims splitting tensor dim ``dim``, outermost first (None: a nesting this module does not model).

    DTensor nests ``Shard`` placements in mesh order; FSDP's ``_StridedShard(dim, split_factor)`` on top of tensor
    parallelism's ``Shard(dim)`` on later mesh dims is split after them (rank (i, j) of dp x tp holds chunk i of
    TP's chunk j)."""
    mesh, placements = tensor.device_mesh, tensor.placements
    splitting = [m for m, p in enumerate(placements) if p.is_shard(dim) or _strided(p, dim)]
    strided = [m for m in splitting if _strided(placements[m], dim)]
    if not strided:
        return [m for m in splitting if mesh.size(m) > 1]
    inner = strided[0]
    later = [m for m in splitting if m > inner]
    if len(strided) > 1 or splitting[0] != inner or placements[inner].split_factor != math.prod(map(mesh.size, later)):
        return None
    return [m for m in [*later, inner] if mesh.size(m) > 1]


def _strided(placement, dim: int) -> bool:
    return type(placement).__name__ == "_StridedShard" and placement.dim == dim


def _plan_exchange(param: torch.Tensor) -> _Exchange | None:
    """How ``param``'s matrices (its last two dims) are gathered whole on one owner each; None when each rank holds
    whole matrices already (a plain tensor, a replicated one, experts split only over the expert dim)."""
    if not isinstance(param, DTensor):
        return None
    if any(p.is_partial() for p in param.placements):
        raise _Unmodelled
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    stages, gathering, local_shape = [], set(), list(param.shape)
    for dim in (param.ndim - 2, param.ndim - 1):
        nesting = _nesting(param, dim)
        if nesting is None:
            raise _Unmodelled
        extents = [param.shape[dim]]
        for mesh_dim in nesting:  # outermost first: the extent each split cuts
            extents.append(_chunk_sizes(extents[-1], mesh.size(mesh_dim))[coordinate[mesh_dim]])
        local_shape[dim] = extents[-1]
        gathering.update(nesting)
        stages += [(mesh_dim, dim, extent) for mesh_dim, extent in zip(reversed(nesting), reversed(extents[:-1]))]
    if not gathering:
        return None
    local = param.to_local().shape
    local_shape[:-2] = local[:-2]  # the expert dim, if split (expert parallelism), stays as it is
    if tuple(local_shape) != tuple(local):
        raise _Unmodelled
    order = sorted(gathering)
    sizes = tuple(mesh.size(m) for m in order)
    slot = 0
    for mesh_dim in order:
        slot = slot * mesh.size(mesh_dim) + coordinate[mesh_dim]
    placed = tuple(_Stage(m, dim, extent, order.index(m)) for m, dim, extent in stages)
    return _Exchange(mesh, tuple(order), sizes, placed, slot)


class _Unmodelled(Exception):
    """A parameter split in a way the owner exchange does not model: gathered whole on every rank instead."""


def _gather(batch: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
    """``batch``: (*exchange.sizes, *local shard), one matrix per owner slot; returns this rank's slot, whole
    (1, ..., 1, *matrix): one all-to-all per gathering mesh dim, innermost split first."""
    lead = len(exchange.sizes)
    for stage in exchange.stages:
        group = exchange.mesh.get_group(stage.mesh_dim)
        me, ranks = dist.get_rank(group), dist.get_world_size(group)
        pieces = [piece.contiguous() for piece in batch.split(1, dim=stage.axis)]  # piece r: rank r's slot
        mine = list(pieces[me].shape)
        shapes = []
        for size in _chunk_sizes(stage.extent, ranks):
            shapes.append([*mine[: lead + stage.tensor_dim], size, *mine[lead + stage.tensor_dim + 1 :]])
        received = _all_to_all(pieces, shapes, group)
        batch = torch.cat(received, dim=lead + stage.tensor_dim)
    return batch


def _scatter(whole: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
    """The inverse of :func:`_gather`: every rank's owned result back to (*exchange.sizes, *local shard)."""
    lead = len(exchange.sizes)
    for stage in reversed(exchange.stages):
        group = exchange.mesh.get_group(stage.mesh_dim)
        me, ranks = dist.get_rank(group), dist.get_world_size(group)
        sizes = _chunk_sizes(stage.extent, ranks)
        pieces = [piece.contiguous() for piece in whole.split(sizes, dim=lead + stage.tensor_dim)]
        mine = list(pieces[me].shape)
        received = _all_to_all(pieces, [mine] * ranks, group)
        whole = torch.cat(received, dim=stage.axis)
    return whole


def _all_to_all(pieces: list[torch.Tensor], shapes: list[list[int]], group) -> list[torch.Tensor]:
    """Send ``pieces[r]`` to rank r of ``group``; returns what each rank sent here, shaped ``shapes[r]``."""
    counts = [math.prod(shape) for shape in shapes]
    # (In a rehearsal the all-to-all is meshtron.distributed.one_rank_group's: it writes this rank's own pieces.)
    out = torch.empty(sum(counts), dtype=pieces[0].dtype, device=pieces[0].device)
    dist.all_to_all_single(
        out,
        torch.cat([piece.reshape(-1) for piece in pieces]),
        output_split_sizes=counts,
        input_split_sizes=[piece.numel() for piece in pieces],
        group=group,
    )
    return [part.view(shape) for part, shape in zip(out.split(counts), shapes)]


def _cost(param: torch.Tensor) -> int:
    """Newton-Schulz work on one of ``param``'s matrices, up to a constant: rows * cols * min(rows, cols)."""
    rows, cols = param.shape[-2:]
    return math.prod(param.shape) * min(rows, cols)


def orthogonalized(params: list, update_of, steps: int, dtype: torch.dtype = torch.float32):
    """Yield ``(param, direction)`` for each of ``params``: Newton-Schulz of its update (``update_of(param)``,
    computed when needed) as one process would compute it, sharded like the parameter.

    Each whole matrix is orthogonalized by one owner rank among those that split it: parameters split alike
    (same mesh, placements and shape) go in batches of one matrix per owner, balanced by Newton-Schulz work; each
    rank's shards are cast to ``dtype`` (the iteration's) and sent to the owners by one all-to-all per splitting
    mesh dim, and the results come back the same way. Ranks that hold whole matrices orthogonalize them
    themselves (plain tensors under DDP or one process, replicated ones, experts split only over experts).
    """
    buckets: dict = {}
    for param in params:
        try:
            exchange = _plan_exchange(param)
        except _Unmodelled:  # every rank gathers it whole (correct for any placements, more traffic and work)
            update = update_of(param)
            partial = any(p.is_partial() for p in update.placements)  # summed in its own dtype first
            whole = (update.full_tensor() if partial else update.to(dtype).full_tensor()).to(dtype)
            whole = newton_schulz(whole, steps, dtype).to(update.dtype)
            yield param, distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
            continue
        if exchange is None:
            yield param, _orthogonalize_local(update_of(param), steps, dtype)
            continue
        key = (exchange, tuple(param.placements), tuple(param.shape))
        buckets.setdefault(key, []).append(param)
    loads: dict = {}
    for (exchange, _, _), members in sorted(buckets.items(), key=lambda item: -_cost(item[1][0])):
        load = loads.setdefault((exchange.mesh, exchange.mesh_dims), [0] * exchange.owners)
        cost = _cost(members[0])
        for start in range(0, len(members), exchange.owners):
            batch = members[start : start + exchange.owners]
            slots = sorted(sorted(range(exchange.owners), key=lambda slot: (load[slot], slot))[: len(batch)])
            for slot in slots:
                load[slot] += cost
            yield from _orthogonalize_batch(dict(zip(slots, batch)), exchange, update_of, steps, dtype)


def _orthogonalize_batch(owned_by: dict, exchange: _Exchange, update_of, steps: int, dtype: torch.dtype):
    """One batch: ``owned_by[slot]`` is the parameter whose matrices the rank at ``slot`` orthogonalizes."""
    updates = {slot: update_of(param) for slot, param in owned_by.items()}
    for slot, param in owned_by.items():
        if updates[slot].placements != param.placements:
            updates[slot] = updates[slot].redistribute(param.device_mesh, param.placements)
    first = next(iter(updates.values()))
    local_shape = first.to_local().shape
    shards = [
        updates[slot].to_local().to(dtype) if slot in updates else first.to_local().new_zeros(local_shape, dtype=dtype)
        for slot in range(exchange.owners)
    ]
    # The mesh's device carries the exchange (under fsdp.cpu_offload the shards are on the host, NCCL wants the GPU)
    device = torch.device(exchange.mesh.device_type)
    whole = _gather(torch.stack(shards).view(*exchange.sizes, *local_shape).to(device), exchange)
    if exchange.slot in updates:  # as one process computes it: on the matrix's own shape (a 2-D matmul for 2-D)
        result = newton_schulz(whole.view(whole.shape[len(exchange.sizes) :]), steps, dtype).view(whole.shape)
    else:  # no matrix for this rank in this batch
        result = torch.zeros_like(whole)
    results = _scatter(result, exchange).reshape(exchange.owners, *local_shape)
    for slot, param in owned_by.items():
        update = updates[slot]
        local = results[slot].to(update.to_local().device, update.dtype)
        yield param, dtensor_like(local, update)


def _orthogonalize_local(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of matrices this rank holds whole (a plain tensor, or a DTensor's local shard)."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype).to(update.dtype)
    local = newton_schulz(update.to_local(), steps, dtype).to(update.dtype)
    return dtensor_like(local, update)


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Newton-Schulz of ``update`` as one process would compute it, sharded like ``update``."""
    ((_, direction),) = orthogonalized([update], lambda _: update, steps, dtype)
    return direction


class MuonAdamW(torch.optim.AdamW):
    """AdamW (torch's, fused where it can be) whose ``muon`` parameter group steps with Muon instead.

    One optimizer, so the learning-rate schedule, gradient clipping, checkpoints (``momentum_buffer`` beside AdamW's
    ``exp_avg`` / ``exp_avg_sq``) and everything else that takes "the optimizer" work unchanged.
    """

    param_groups: list[dict]  # torch.optim.Optimizer's; ``step`` hides the muon group from AdamW's step

    def __init__(
        self,
        muon_params: list,
        adamw_groups: list[dict],
        *,
        momentum: float,
        ns_steps: int,
        ns_dtype: torch.dtype = torch.float32,
        **adamw,
    ):
        groups = [*adamw_groups, {"params": muon_params, "muon": True, "momentum": momentum, "ns_steps": ns_steps}]
        super().__init__([group for group in groups if group["params"]], **adamw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        every_group = self.param_groups
        for group in every_group:
            if group.get("muon"):
                self._muon_step(group)
        try:  # AdamW's own step over its groups only
            self.param_groups = [group for group in every_group if not group.get("muon")]
            super().step()
        finally:
            self.param_groups = every_group
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, decay = group["lr"], group["weight_decay"]
        params = [param for param in group["params"] if param.grad is not None]
        nesterov = functools.partial(self._nesterov, momentum=group["momentum"])
        for param, direction in orthogonalized(params, nesterov, group["ns_steps"], self.ns_dtype):
            param.mul_(1 - lr * decay)
            param.add_(direction, alpha=-lr * RMS_MATCH * math.sqrt(max(param.shape[-2:])))

    def _nesterov(self, param: torch.Tensor, momentum: float) -> torch.Tensor:
        """Step ``param``'s momentum buffer with its gradient; returns the Nesterov update (Muon orthogonalizes it)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
            state["step"] = torch.zeros((), dtype=torch.float32)  # AdamW's load_state_dict wants one in every entry
        state["step"] += 1
        buffer = state["momentum_buffer"]
        buffer.lerp_(param.grad, 1 - momentum)
        return param.grad.lerp(buffer, momentum)


def muon_parameters(parts: list[nn.Module], adapter) -> list[nn.Parameter]:
    """The parameters Muon takes: every 2-D or 3-D (expert) weight of the decoder blocks of ``parts`` (the model, or
    a rank's pipeline stages) except MoE routers."""
    from meshtron.models.moe import moe_blocks, router_of

    chosen: list = []
    routers: set = set()
    for part in parts:
        for _, block in adapter.named_blocks(part):
            routers.update(id(p) for _, moe in moe_blocks(block) for p in router_of(moe).parameters())
            chosen += [
                p
                for name, p in block.named_parameters()
                # gpt-oss's experts' biases ([E, 2I], [E, H]) are vectors per expert, not matrices
                if p.requires_grad and p.ndim in (2, 3) and id(p) not in routers and not name.endswith("_bias")
            ]
    unique = {id(p): p for p in chosen}
    return list(unique.values())


@dataclass(frozen=True)
class MuonSettings:
    """``[optimizer.muon]``: Muon's own settings (docs/optimizers.md)."""

    momentum: float = 0.95
    """the momentum of Muon's (Nesterov) update, in [0, 1)."""
    ns_steps: int = 5
    """the Newton-Schulz iterations that orthogonalize the momentum."""

    def validate(self) -> None:
        if self.ns_steps < 1:
            raise ConfigError(f"optimizer.muon.ns_steps: must be a positive integer, got {self.ns_steps}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.muon.momentum: must be in [0, 1), got {self.momentum}")


def build_muon(
    model: nn.Module,
    cfg: OptimizerConfig,
    settings: MuonSettings,
    *,
    parts: list[nn.Module] | None = None,
    adapter=None,
    compute_dtype: torch.dtype | None = None,
) -> MuonAdamW:
    """Muon for the decoder blocks' matrices of ``parts`` (the model, or this rank's pipeline stages; ``adapter``:
    their family's), AdamW for the rest; Newton-Schulz in bf16 when ``compute_dtype`` (the mixed precision's) is
    bf16, else in float32."""
    muon = muon_parameters(parts or [model], adapter)
    groups = adamw_groups(model, cfg, {id(p) for p in muon})
    ns_dtype = torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32
    return MuonAdamW(
        muon,
        groups,
        momentum=settings.momentum,
        ns_steps=settings.ns_steps,
        ns_dtype=ns_dtype,
        **adamw_arguments(cfg, groups),
    )


def newton_schulz_flops(settings: MuonSettings, rows: int, cols: int) -> float:
    """Muon's step on one whole (rows, cols) matrix: ``ns_steps`` Newton-Schulz iterations of ``4 m^2 n + 2 m^3``
    FLOPs, m <= n (the planner's estimate of its time, meshtron.plan.throughput)."""
    small, large = min(rows, cols), max(rows, cols)
    return settings.ns_steps * (4 * small * small * large + 2 * small**3)
