"""FSDP2 / HSDP with ``fully_shard``, per decoder block then the root; DDP for pure replication."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from meshtron.config import FSDPConfig
from meshtron.models.adapter import DecoderAdapter


def apply_fsdp(
    model: nn.Module, adapter: DecoderAdapter, dp_mesh, fsdp_cfg: FSDPConfig, policy: MixedPrecisionPolicy,
    pipelined: bool = False,
) -> None:
    """Shard every decoder block, then the root (embeddings, final norm, head) over ``dp_mesh``.

    ``dp_mesh`` is ``dp_shard x cp`` flattened (context-parallel ranks hold the same parameters), with
    ``dp_replicate`` in front for HSDP. When that sharding dim has size 1 every rank holds the whole
    model: that is DDP, and plain replication (``replicate_whole_model``) runs it (see ``replicates_only``).
    ``policy``: the run's mixed precision (meshtron.train.precision).
    """
    if replicates_only(model, dp_mesh, policy, fsdp_cfg.cpu_offload, pipelined):
        replicate_whole_model(model, dp_mesh)
        return
    offload = CPUOffloadPolicy() if fsdp_cfg.cpu_offload else OffloadPolicy()
    reshard_setting = fsdp_cfg.reshard_after_forward
    reshard_blocks = not pipelined if reshard_setting is None else reshard_setting
    blocks = [block for _, block in adapter.named_blocks(model)]
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_blocks and index < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)


def replicates_only(model: nn.Module, dp_mesh, policy: MixedPrecisionPolicy, cpu_offload: bool, pipelined: bool) -> bool:
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


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on (last micro-batch) or off (earlier micro-batches of an accumulation)."""
    from torch.distributed._composable.replicate import DDP

    if isinstance(model, (FSDPModule, DDP)):
        model.set_requires_gradient_sync(enabled)
