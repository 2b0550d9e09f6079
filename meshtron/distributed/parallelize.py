"""The one place that applies every parallelism to a model, in order.

Order: pipeline split (first), then for each stage: tensor parallel, context parallel, activation
checkpointing, compile, FSDP/HSDP. Each step only talks to the model through its adapter.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshtron.config import Config
from meshtron.distributed.data_parallel import apply_fsdp
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.pipeline_parallel import split_pipeline
from meshtron.distributed.tensor_parallel import apply_tensor_parallel
from meshtron.models.adapter import DecoderAdapter
from meshtron.models.attention import register_attention, uses_meshtron_attention

# Selective checkpointing keeps the outputs of these (expensive) ops and recomputes the rest.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, adapter: DecoderAdapter, mode: str) -> None:
    """Wrap each decoder block: ``full`` recomputes the whole block in backward, ``selective`` all but matmuls/attention."""
    if mode == "none":
        return
    for name, block in adapter.named_blocks(model):
        if mode == "full":
            adapter.replace_block(model, name, checkpoint_wrapper(block, preserve_rng_state=False))
        else:
            context = partial(create_selective_checkpoint_contexts, _selective_policy)
            adapter.replace_block(model, name, checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context))


def apply_compile(model: nn.Module, adapter: DecoderAdapter) -> None:
    """Compile each decoder block in place (parameter names unchanged)."""
    for _, block in adapter.named_blocks(model):
        block.compile()


def parallelize(model: nn.Module, adapter: DecoderAdapter, dims: ParallelDims, meshes, cfg: Config) -> list[tuple[int, nn.Module]]:
    """Apply every parallelism to a meta-device model: PP split -> (per stage) TP -> CP -> activation
    checkpointing -> compile -> FSDP. Returns (pipeline stage id, module) for each stage this rank holds
    (one, stage 0, without pipeline parallelism)."""
    if dims.pp > 1:
        stages = split_pipeline(model, adapter, cfg.parallel, meshes["world"]["pp"].get_local_rank())
    else:
        stages = [(0, model)]
    return [(stage_id, parallelize_model(stage, adapter, dims, meshes, cfg)) for stage_id, stage in stages]


def parallelize_model(model: nn.Module, adapter: DecoderAdapter, dims: ParallelDims, meshes, cfg: Config) -> nn.Module:
    """Apply TP -> CP -> activation checkpointing -> compile -> FSDP to one (stage of a) meta-device model.

    Context parallelism changes no parameter: its step routes attention to meshtron's function (which
    also does document masking without CP); the trainer shards each batch over the ``cp`` ranks, and
    FSDP shards over ``dp_shard x cp`` so that gradients are reduced over the context-parallel ranks too.
    """
    if dims.tp > 1:
        apply_tensor_parallel(
            model,
            adapter,
            meshes["world"]["tp"],
            sequence_parallel=cfg.parallel.sequence_parallel,
            loss_parallel=cfg.parallel.loss_parallel,
        )
    if uses_meshtron_attention(dims.cp, cfg.data.mask_documents, dims.pp):
        adapter.use_attention(model, register_attention())
    apply_activation_checkpointing(model, adapter, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        apply_compile(model, adapter)
    if dims.fsdp_enabled:
        apply_fsdp(model, adapter, meshes["fsdp"], cfg.fsdp, cfg.model.dtype, pipelined=dims.pp > 1)
    return model
