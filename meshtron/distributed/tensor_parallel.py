"""Tensor parallelism (Megatron-style) with sequence parallel and loss parallel, on PyTorch's ``parallelize_module``.

Per decoder block: q/k/v and gate/up are column-parallel (each rank computes its own heads / its
slice of the MLP), o and down are row-parallel (partial sums reduced at the output). Embeddings are
split over the vocabulary, the head over its output vocabulary.

Sequence parallel: between the attention and MLP regions the residual stream, norms and dropout are
split over the sequence (``Shard(1)``); entering attention or the MLP the sequence is all-gathered,
leaving it the row-parallel output is reduce-scattered back to sequence shards. Without it the
residual stream is replicated on every tp rank and the row-parallel outputs are all-reduced.

Loss parallel: the head's logits stay split over the vocabulary and cross-entropy runs on the shards.

Any vocabulary size: a vocabulary ``tp`` does not divide is split unevenly, as ``torch.chunk`` splits
(``Shard(0)``: the first ranks hold ``ceil(vocab / tp)`` rows, the last the rest; 50,257 at tp=4 is
12,565 x 3 + 12,562). No padding row exists, so none can win a softmax or take a gradient, and the
parameters keep the model's true shape: checkpoints (DCP stores each shard with its offset), resuming
under another tp and ``meshtron export`` see the true vocabulary. The embedding's masked lookup and loss
parallel's cross-entropy take each rank's row offset from the same uneven split.

GQA with fewer KV heads than ``tp``: the k/v projections are replicated on every tp rank and each rank
keeps the KV head its query heads use. Their gradient (and that of per-head norms and of
sequence-parallel norms) is a partial sum per rank; FSDP reduces it, and ``reduce_partial_gradients``
does when there is no FSDP.

Float8 (``precision.float8``, on CUDA, tensorwise recipe): the blocks' float8 linears use torchao's float8
styles, which cast to float8 before the sequence all-gather (once per attention / MLP input) and cast
output gradients in backward. Rowwise float8 linears keep the ordinary styles (high-precision collectives).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from meshtron.distributed.float8 import float8_tp_paths
from meshtron.distributed.lora_tensor_parallel import put_back_adapters, take_off_adapters
from meshtron.distributed.tp_styles import (
    AttentionSinksParallel,
    GatheredNormParallel,
    LatentRopeParallel,
    ReplicatedBlockParallel,
    ReplicatedKVProjection,
    ReplicateParallel,
)
from meshtron.errors import ConfigError
from meshtron.models.adapter import DecoderAdapter
from meshtron.tensors import dtensor_like


def check_tensor_parallel(
    hf_config, adapter: DecoderAdapter, tp: int, seq_len: int, sequence_parallel: bool, cp: int = 1
) -> None:
    """Refuse a tp degree the model cannot be split by, naming the setting and a fix (no process group needed). A
    family's own refusals are ``check_family``'s, which ``check_layout`` runs before this.

    ``seq_len`` is the whole sequence; under context parallelism each rank holds ``seq_len / cp`` of it.
    """
    if tp == 1:
        return
    shape = adapter.attention_shape(hf_config)
    if shape.num_heads % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the model's {shape.num_heads} attention heads; "
            f"use a tp that divides {shape.num_heads}"
        )
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise ConfigError(
            f"parallel.tp={tp} and the model's {shape.num_kv_heads} KV heads: one must divide the other; "
            f"use a tp that divides {shape.num_kv_heads} or a multiple of it"
        )
    # The vocabulary need not divide: DTensor splits the embedding and head rows unevenly (module docstring).
    size = hf_config.intermediate_size
    if size % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the model's intermediate_size {size}; use a tp that divides {size}"
        )
    if sequence_parallel and (seq_len // cp) % tp:
        length = (
            f"data.seq_len {seq_len}" if cp == 1 else f"data.seq_len {seq_len} / parallel.cp={cp} = {seq_len // cp}"
        )
        raise ConfigError(
            f"{length} is not divisible by parallel.tp={tp} (sequence parallel splits the sequence); "
            f"use a data.seq_len that is a multiple of {tp * cp} or set parallel.sequence_parallel=false"
        )


def _float8_styles(roles: dict[str, str], float8_paths: frozenset[str]):
    """(prepare input, colwise, rowwise) style classes per path: torchao's float8 ones for float8 linears
    and for an attention / MLP region whose every input projection is one."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    classes = {}
    for path, role in roles.items():
        if role in ("attention", "attention_sinks", "attention_positional", "mlp"):
            inside = {p: r for p, r in roles.items() if p.startswith(path + ".")}
            inputs = [p for p, r in inside.items() if r in ("colwise", "kv_colwise")]
            # MLA's latents (computed whole, role replicated) take the region's input, not its colwise projections.
            takes_input = not any(r in ("replicated", "latent_rope") for r in inside.values())
            if inputs and takes_input and all(p in float8_paths for p in inputs):
                classes[path] = PrepareFloat8ModuleInput
        elif path in float8_paths and role in ("colwise", "kv_colwise", "rowwise"):
            classes[path] = Float8RowwiseParallel if role == "rowwise" else Float8ColwiseParallel
    return classes


def _block_styles(
    roles: dict[str, str], shape, tp: int, sequence_parallel: bool, float8_paths: frozenset[str] = frozenset()
) -> dict[str, ParallelStyle]:
    stream = Shard(1) if sequence_parallel else Replicate()
    float8 = _float8_styles(roles, float8_paths) if float8_paths else {}
    styles: dict[str, ParallelStyle] = {}
    for path, role in roles.items():
        if role in ("attention", "attention_sinks"):
            styles[path] = float8.get(path, PrepareModuleInput)(
                input_kwarg_layouts={"hidden_states": stream},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=False,
            )
            if role == "attention_sinks":
                styles[path] = AttentionSinksParallel(styles[path])
        elif role == "attention_positional":  # called with the hidden states as its first positional argument
            styles[path] = float8.get(path, PrepareModuleInput)(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
            )
        elif role == "mlp":
            styles[path] = float8.get(path, PrepareModuleInput)(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
            )
        elif role == "colwise":
            styles[path] = float8.get(path, ColwiseParallel)()
        elif role == "kv_colwise":
            if shape.num_kv_heads >= tp:
                styles[path] = float8.get(path, ColwiseParallel)()
            else:
                styles[path] = ReplicatedKVProjection(shape.num_kv_heads, shape.head_dim)
        elif role == "rowwise":
            styles[path] = float8.get(path, RowwiseParallel)(
                output_layouts=stream, use_local_output=not sequence_parallel
            )
        elif role == "norm":
            styles[path] = SequenceParallel() if sequence_parallel else ReplicateParallel()
        elif role == "gathered_norm":
            styles[path] = GatheredNormParallel()
        elif role == "replicated":  # a small module computed whole on every tp rank inside attention (MLA's latents)
            styles[path] = ReplicateParallel()
        elif role == "latent_rope":
            styles[path] = LatentRopeParallel(shape.rope_dim)
        elif role == "replicated_block":
            styles[path] = ReplicatedBlockParallel(sequence_parallel)
        elif role == "head_norm":
            # Works on [batch, seq, local heads, head_dim]: the heads dim is the split one.
            styles[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
        else:
            raise ValueError(f"unknown tensor-parallel role '{role}' for '{path}'")
    return styles


def _top_styles(roles: dict[str, str], sequence_parallel: bool, loss_parallel_on: bool) -> dict[str, ParallelStyle]:
    stream = Shard(1) if sequence_parallel else Replicate()
    styles: dict[str, ParallelStyle] = {}
    for path, role in roles.items():
        if role == "embedding":
            styles[path] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
            )
        elif role == "norm":
            styles[path] = SequenceParallel() if sequence_parallel else ReplicateParallel()
        elif role == "head":
            styles[path] = ColwiseParallel(
                input_layouts=stream,
                output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
                use_local_output=not loss_parallel_on,
            )
        else:
            raise ValueError(f"unknown tensor-parallel role '{role}' for '{path}'")
    return styles


def apply_tensor_parallel(
    model: nn.Module,
    adapter: DecoderAdapter,
    tp_mesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    float8: bool = False,
) -> None:
    """Split ``model`` (on the meta device) over the 1-D ``tp_mesh``, block by block, then the outer parts.

    ``float8``: the blocks were converted by ``meshtron.distributed.float8.apply_float8``; their float8 linears
    get torchao's float8 styles, which all-gather in float8 (NCCL only: gloo cannot send float8; without
    them float8 linears still multiply in float8 and all-gather in high precision). Tensorwise recipe
    only: those styles cast per tensor, so rowwise float8 linears keep the ordinary styles.
    """
    tp = tp_mesh.size()
    shape = adapter.attention_shape(model.config)
    # PyTorch's styles make new Parameters (trainable) for what they split or replicate: keep frozen ones frozen.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for _, block in adapter.named_blocks(model):
        float8_paths = float8_tp_paths(block) if float8 else frozenset()
        roles = adapter.block_tp_roles(block)
        styles = _block_styles(roles, shape, tp, sequence_parallel, float8_paths)
        adapters = take_off_adapters(block, roles)  # LoRA: split as their projections (lora_tensor_parallel)
        parallelize_module(block, tp_mesh, styles, src_data_rank=None)
        put_back_adapters(block, adapters, roles, tp_mesh, kv_replicated=shape.num_kv_heads < tp)
    parallelize_module(
        model, tp_mesh, _top_styles(adapter.top_tp_roles(model), sequence_parallel, loss_parallel), src_data_rank=None
    )
    adapter.tie_weights(model)
    adapter.set_local_heads(model, shape.num_heads // tp, max(shape.num_kv_heads // tp, 1))
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def loss_context(logits: torch.Tensor):
    """The context cross-entropy (forward and backward) must run in: loss parallel for vocab-sharded logits."""
    if isinstance(logits, DTensor) and any(isinstance(p, Shard) for p in logits.placements):
        return loss_parallel()
    return contextlib.nullcontext()


@torch.no_grad()
def shard_replicated_gradients(parameters) -> None:
    """Give a sharded parameter whose gradient arrived whole (``Replicate``: DTensor's embedding backward
    does that for the vocab-sharded embedding) a gradient with the parameter's own sharding: a local
    slice, copied so the whole gradient's memory is freed, no communication. Without FSDP, called after
    each accumulated micro-batch so that only the shard is held between them."""
    for param in parameters:
        grad = param.grad
        if (
            not isinstance(grad, DTensor)
            or grad.placements == param.placements
            or not all(isinstance(p, Replicate) for p in grad.placements)
        ):
            continue
        local = grad.redistribute(param.device_mesh, param.placements).to_local().clone()
        param.grad = dtensor_like(local, param)


@torch.no_grad()
def reduce_partial_gradients(parameters) -> None:
    """Sum gradients that are partial over some mesh dims (replicated weights used by sharded work).

    FSDP does this itself when it reduces gradients; without FSDP it is needed before the gradient is
    read. Gradients on the same mesh dims are summed with one all-reduce.
    """
    pending: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements == param.placements:
            continue
        dims = tuple(i for i, p in enumerate(grad.placements) if isinstance(p, Partial))
        if not dims or any(not isinstance(param.placements[i], Replicate) for i in dims):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
            continue
        pending[(id(grad.device_mesh), dims)].append(param)
    for (_, dims), params in pending.items():
        mesh = params[0].grad.device_mesh
        locals_ = [p.grad.to_local() for p in params]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        for param, piece in zip(params, torch.split(flat, [t.numel() for t in locals_])):
            param.grad = DTensor.from_local(
                piece.view_as(param.grad.to_local()), mesh, param.placements, run_check=False
            )
