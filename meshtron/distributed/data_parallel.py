"""FSDP2 / HSDP with ``fully_shard``, per decoder block then the root; DDP for pure replication."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from meshtron.config import FSDPConfig
from meshtron.distributed.expert_parallel import shard_experts
from meshtron.distributed.mesh import is_fake_group
from meshtron.errors import ConfigError
from meshtron.models.adapter import DecoderAdapter
from meshtron.models.moe import moe_blocks


def apply_fsdp(
    model: nn.Module,
    adapter: DecoderAdapter,
    dp_mesh,
    fsdp_cfg: FSDPConfig,
    policy: MixedPrecisionPolicy,
    pipelined: bool = False,
    expert_mesh=None,
) -> None:
    """Shard every decoder block, then the root (embeddings, final norm, head) over ``dp_mesh``.

    ``dp_mesh`` is ``dp_shard x cp`` flattened (context-parallel ranks hold the same parameters), with
    ``dp_replicate`` in front for HSDP. When that sharding dim has size 1 every rank holds the whole
    model: that is DDP, and plain replication (``replicate_whole_model``) runs it (see ``replicates_only``).
    ``policy``: the run's mixed precision (meshtron.distributed.precision). ``expert_mesh``: under expert
    parallelism, the mesh the experts of each MoE block are sharded over instead (``expert_fsdp``: the ranks
    holding the same experts), their gradients divided as the others' (``expert_parallel.shard_experts``).
    """
    if replicates_only(model, dp_mesh, policy, fsdp_cfg.cpu_offload, pipelined):
        if any(p.requires_grad for p in model.parameters()):  # a frozen model (a reference) has nothing to reduce
            replicate_whole_model(model, dp_mesh)
        return
    # Pinned host memory makes the host-device copies asynchronous; without a GPU there is nothing to pin.
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if fsdp_cfg.cpu_offload else OffloadPolicy()
    reshard_setting = fsdp_cfg.reshard_after_forward
    reshard_blocks = not pipelined if reshard_setting is None else reshard_setting
    blocks = [block for _, block in adapter.named_blocks(model)]
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_blocks and index < len(blocks) - 1
        if expert_mesh is not None:
            for _, moe_block in moe_blocks(block):
                shard_experts(
                    moe_block.experts,
                    expert_mesh,
                    dp_mesh.size(),
                    mp_policy=policy,
                    offload_policy=offload,
                    reshard_after_forward=reshard,
                )
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)


def reshard_all(*models: nn.Module) -> None:
    """Shard every FSDP module's parameters again, as a step's backward leaves them. After a forward that no backward
    follows (evaluation), modules that keep their parameters gathered after forward (the last block, the root) would
    otherwise enter the next training step gathered, and FSDP then left some gradients undivided (measured: the last
    block's expert-parallel experts under FSDP x TP got twice their gradient)."""
    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def forget_forwards(*models: nn.Module) -> None:
    """Drop FSDP2's record of the forwards run since the last backward (the order in which its backward prefetches),
    which only a backward clears: for a model that never runs one (a preference reference) it would grow by an entry
    per FSDP module and forward for the whole run. FSDP2's private state, read defensively (a torch that keeps it
    elsewhere keeps its record)."""
    for model in models:
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            for group in groups:
                indices = getattr(group, "_post_forward_indices", None)
                if indices is not None:
                    indices.clear()
            order = getattr(getattr(state, "_comm_ctx", None), "post_forward_order", None)
            if order is not None:
                order.clear()


def check_data_parallel(fsdp_cfg: FSDPConfig, dims) -> None:
    """Refuse FSDP settings the layout cannot honour (``dims``: the run's ParallelDims)."""
    if fsdp_cfg.cpu_offload and not dims.fsdp_applied(fsdp_cfg.cpu_offload):
        raise ConfigError(
            "fsdp.cpu_offload needs FSDP (parallel.dp_shard, dp_replicate or cp > 1, or a single process), and this "
            "layout has no data parallelism; set fsdp.cpu_offload=false or use more than one data-parallel rank"
        )


def parameter_device(fsdp_cfg: FSDPConfig, device: torch.device) -> torch.device:
    """Where parameters are materialized: the CPU under ``fsdp.cpu_offload`` (FSDP2 requires offloaded
    shards to start there and copies them to ``device`` for compute), else ``device``."""
    return torch.device("cpu") if fsdp_cfg.cpu_offload else device


def replicates_only(
    model: nn.Module, dp_mesh, policy: MixedPrecisionPolicy, cpu_offload: bool, pipelined: bool
) -> bool:
    """Whether data parallelism here is pure replication that DDP runs as well as FSDP would: a sharding
    dim of 1 (no dp_shard, no cp), no pipeline stages, plain full-size parameters (no tensor parallelism or
    float8), compute and gradient reduction in the parameters' own dtype, and no CPU offload.

    ``fully_shard`` on such a mesh reduces each block's gradients in its own blocking all-reduce;
    DDP all-reduces ~25 MB buckets in the background while backward goes on, with no DTensors in the
    optimizer step. Mixed precision and offload stay with FSDP, whose policies implement them.
    """
    if pipelined or cpu_offload or dp_mesh.ndim != 2 or dp_mesh.size(1) != 1:
        return False
    params = list(model.parameters())
    if not params or any(isinstance(p, DTensor) or type(p.data) is not torch.Tensor for p in params):
        return False
    dtypes = {p.dtype for p in params}
    return len(dtypes) == 1 and {policy.param_dtype, policy.reduce_dtype} <= dtypes | {None}


def replicate_whole_model(model: nn.Module, dp_mesh) -> None:
    """DDP over the replicate dim of ``dp_mesh``, in place (parameter names unchanged).

    Buffers are not broadcast (meshtron builds them identically on every rank) and neither are the
    initial weights (fresh ones are seeded by name, pretrained ones read by every rank); gradients are
    views into DDP's buckets, so they take no extra memory.
    """
    from torch.distributed._composable.replicate import replicate

    replicate(
        model,
        process_group=dp_mesh.get_group(0),
        broadcast_buffers=False,
        init_sync=False,
        gradient_as_bucket_view=True,
    )
    if is_fake_group(dp_mesh.get_group(0)):
        model.register_comm_hook(None, _keep_local_gradients)


def _keep_local_gradients(state, bucket):
    """DDP's communication hook on a fake process group, whose all-reduce hands back no tensor: this rank's own."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def set_gradient_sync(model: nn.Module, last_micro_batch: bool, accumulate_unsharded: bool = False) -> None:
    """Gradient reduction for one micro-batch of a gradient accumulation.

    DDP all-reduces on the last micro-batch only (its gradients are full-size anyway). FSDP / HSDP
    reduce-scatter every micro-batch, so a rank holds only gradient shards between micro-batches, and
    HSDP all-reduces the accumulated shards over the replicas on the last one. ``accumulate_unsharded``
    (``fsdp.accumulate_unsharded``) defers the reduce-scatter to the last micro-batch too: full-size
    gradients are held in between, for one reduce-scatter per step.
    """
    from torch.distributed._composable.replicate import DDP

    if isinstance(model, DDP) or (isinstance(model, FSDPModule) and accumulate_unsharded):
        model.set_requires_gradient_sync(last_micro_batch)
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(True)  # sets both flags: reduce-scatter and all-reduce
        model.set_requires_all_reduce(last_micro_batch)
