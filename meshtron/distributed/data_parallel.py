"""FSDP2 / HSDP / replicated data parallelism with ``fully_shard``, per decoder block then the root."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from meshtron.config import FSDPConfig
from meshtron.models.adapter import DecoderAdapter
from meshtron.models.build import torch_dtype


def apply_fsdp(
    model: nn.Module, adapter: DecoderAdapter, dp_mesh, fsdp_cfg: FSDPConfig, model_dtype: str, pipelined: bool = False
) -> None:
    """Shard every decoder block, then the root (embeddings, final norm, head) over ``dp_mesh``.

    ``dp_mesh`` is ``dp_shard x cp`` flattened (context-parallel ranks hold the same parameters), with
    ``dp_replicate`` in front for HSDP. When that sharding dim has size 1 the mesh shards over one
    rank, which is DDP: parameters replicated, gradients all-reduced.
    """
    policy = MixedPrecisionPolicy(
        param_dtype=torch_dtype(fsdp_cfg.param_dtype or model_dtype),
        reduce_dtype=torch_dtype(fsdp_cfg.reduce_dtype) if fsdp_cfg.reduce_dtype else None,
    )
    offload = CPUOffloadPolicy() if fsdp_cfg.cpu_offload else OffloadPolicy()
    reshard_setting = fsdp_cfg.reshard_after_forward
    reshard_blocks = not pipelined if reshard_setting is None else reshard_setting
    blocks = [block for _, block in adapter.named_blocks(model)]
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_blocks and index < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on (last micro-batch) or off (earlier micro-batches of an accumulation)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
