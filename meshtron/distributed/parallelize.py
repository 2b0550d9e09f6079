"""The one place that applies every parallelism to a model, in order.

Order: pipeline split (first), then for each stage: float8 conversion (``precision.float8``), expert
parallel (MoE models), tensor parallel, context parallel, activation checkpointing, compile, FSDP/HSDP
(the experts over their own mesh). Each step only talks to the model through its adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtron.config import FSDPConfig, ParallelConfig
from meshtron.distributed.activation_memory.checkpointing import apply_activation_checkpointing
from meshtron.distributed.activation_memory.tiled_mlp import apply_tiled_mlp
from meshtron.distributed.context_parallel import register_attention
from meshtron.distributed.data_parallel import apply_fsdp
from meshtron.distributed.expert_parallel import apply_expert_parallel_to_model
from meshtron.distributed.float8 import apply_float8
from meshtron.distributed.mesh import Meshes, ParallelDims
from meshtron.distributed.pipeline_parallel import split_pipeline
from meshtron.distributed.precision import PrecisionPolicy, apply_compute_casts
from meshtron.distributed.tensor_parallel import apply_tensor_parallel
from meshtron.errors import ConfigError
from meshtron.models.adapter import DecoderAdapter
from meshtron.models.attention import uses_meshtron_attention


def compile_enabled(setting: str, device_type: str) -> bool:
    """``train.compile``: true, false, or auto (on for CUDA, where it pays; off on CPU, where compiling
    costs more than it saves in short runs)."""
    return setting == "true" or (setting == "auto" and device_type == "cuda")


def apply_compile(model: nn.Module, adapter: DecoderAdapter, static_shapes: bool = False) -> None:
    """Compile each decoder block's forward in place (parameter names unchanged).

    Only ``forward`` is compiled, as torchtitan compiles a block before FSDP wraps it: the block's hooks (FSDP's
    all-gathers, meshtron's compute casts) run outside the compiled code, so dynamo never guards on one
    block's parameters and every block reuses the first one's graph. ``static_shapes``: a graph per shape, never a
    dynamic one: two models of one block class (a distillation's teacher and student) share the compiled code's
    cache, where a second width would otherwise make dynamo recompile both with symbolic sizes.
    """
    for _, block in adapter.named_blocks(model):
        block.forward = torch.compile(block.forward, dynamic=False if static_shapes else None)


@dataclass(frozen=True)
class ParallelizeOptions:
    """What applying the parallelisms reads of a run's settings, resolved for its device (built by the train layer
    from the config and preflight's ``RunSetup``: meshtron.train.setup.run_setup.parallelize_options)."""

    parallel: ParallelConfig
    """``[parallel]``: the pipeline split, sequence and loss parallelism."""
    fsdp: FSDPConfig
    """``[fsdp]``: the sharding policy, CPU offload."""
    precision: PrecisionPolicy
    """``precision.mixed_precision`` resolved (meshtron.distributed.precision)."""
    compiled: bool
    """``train.compile`` resolved: the decoder blocks are compiled."""
    static_shapes: bool = False
    """Compiled blocks get a graph per shape, never a dynamic one (``apply_compile``; set for distillation)."""
    float8: bool = False
    """``precision.float8``."""
    float8_recipe: str = "tensorwise"
    """``precision.float8_recipe``."""
    mask_documents: bool = True
    """``data.mask_documents``: meshtron's attention (document masks, or context parallelism) replaces the model's."""
    mlp_tiles: int = 0
    """``train.mlp_tiles``."""
    activation_checkpointing: str = "none"
    """``train.activation_checkpointing``."""


def parallelize(
    model: nn.Module,
    adapter: DecoderAdapter,
    dims: ParallelDims,
    meshes: Meshes | None,
    options: ParallelizeOptions,
    device_type: str | None = None,
) -> list[tuple[int, nn.Module]]:
    """Apply every parallelism to a meta-device model: PP split -> (per stage) float8 -> TP -> CP -> activation
    checkpointing -> compile -> FSDP (or, without FSDP, mixed-precision casts). Returns (pipeline stage id, module)
    for each stage this rank holds (one, stage 0, without pipeline parallelism). ``device_type``: see
    parallelize_model."""
    if dims.pp > 1:
        stages = split_pipeline(model, adapter, options.parallel, meshes.pp.get_local_rank())
    else:
        stages = [(0, model)]
    return [
        (stage_id, parallelize_model(stage, adapter, dims, meshes, options, device_type)) for stage_id, stage in stages
    ]


def parallelize_model(
    model: nn.Module,
    adapter: DecoderAdapter,
    dims: ParallelDims,
    meshes: Meshes | None,
    options: ParallelizeOptions,
    device_type: str | None = None,
) -> nn.Module:
    """Apply float8 -> TP -> CP -> activation checkpointing -> compile -> FSDP to one (stage of a) meta-device model.
    ``device_type``: the device the model will run on (default: the mesh's; needed without a mesh).

    Float8 goes first: the TP styles and FSDP's float8 all-gather need the float8 linears in place; float8
    matmuls are emulated unless ``device_type`` is ``cuda``.

    Context parallelism changes no parameter: its step routes attention to meshtron's function (which
    also does document masking without CP); the trainer shards each batch over the ``cp`` ranks, and
    FSDP shards over ``dp_shard x cp`` so that gradients are reduced over the context-parallel ranks too.
    """
    if device_type is None:
        if meshes is None:
            raise ValueError("parallelize_model: without a device mesh, name the device_type")
        device_type = meshes.world.device_type
    if options.float8:
        apply_float8(
            model,
            adapter,
            device_type=device_type,
            fsdp_enabled=dims.fsdp_applied(options.fsdp.cpu_offload),
            tp=dims.tp,
            recipe=options.float8_recipe,
        )
    if dims.ep > 1:  # before TP, whose replicated MoE block then leaves the (already sharded) experts alone
        apply_expert_parallel_to_model(model, meshes.ep)
    if dims.tp > 1:
        apply_tensor_parallel(
            model,
            adapter,
            meshes.tp,
            sequence_parallel=options.parallel.sequence_parallel,
            loss_parallel=options.parallel.loss_parallel,
            float8=options.float8 and device_type == "cuda",  # gloo cannot send float8 tensors
        )
    if uses_meshtron_attention(dims.cp, options.mask_documents):
        adapter.use_attention(model, register_attention())
    apply_tiled_mlp(adapter.named_blocks(model), adapter.block_tp_roles, options.mlp_tiles)
    apply_activation_checkpointing(model, adapter, options.activation_checkpointing)
    if options.compiled:
        apply_compile(model, adapter, options.static_shapes)
    if dims.fsdp_applied(options.fsdp.cpu_offload):
        if meshes is None:
            raise ConfigError(
                "fsdp.cpu_offload in one process shards over a one-rank mesh, which needs a process group; start "
                "the run with meshtron train (it starts one worker) or torchrun --nproc-per-node 1"
            )
        apply_fsdp(
            model,
            adapter,
            meshes.fsdp,
            options.fsdp,
            options.precision.fsdp_policy(),
            pipelined=dims.pp > 1,
            expert_mesh=meshes.expert_fsdp,
        )
    else:  # the same mixed-precision casts FSDP would do, at the same places
        apply_compute_casts(model, adapter, options.precision, compiled=options.compiled)
    return model
