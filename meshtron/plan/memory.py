"""Per-rank memory of a layout: model state from the real parameter shapes, activations from the model's
anatomy, plus FSDP's gathered buffers and the loss's temporaries.

Model state (parameters, gradients, AdamW's two moments, or Muon's one momentum buffer for the blocks' matrices) is
exact up to FSDP's padding: every
parameter is split by tensor parallelism as meshtron's TP plan splits it, then on dim 0 over
``dp_shard x cp`` with the first rank taking the ceiling. Activations count what autograd keeps
for backward, term by term as Hugging Face's Llama-family code saves it (see docs/planning.md);
``meshtron.distributed.activation_memory.measure`` measures the same quantity in real runs. Every layout computes in
the workload's compute dtype; without FSDP that means per-block compute-dtype copies of the weights,
which autograd keeps too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.plan.layout import DTYPE_BYTES, Layout, Workload
from meshtron.plan.model_shape import ModelShape
from meshtron.train.optim.registry import optimizer_entry

FP32 = 4
INDEX = 8  # int64 token ids and labels


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the busiest rank."""

    params: int
    grads: int
    """The larger of the gradient shards after the step and what is held between microbatches
    (full-size gradients where FSDP defers their reduction; see held_gradient_bytes)."""
    optimizer: int
    activations: int
    """Peak of what autograd keeps for backward (all microbatches in flight)."""
    gathered: int
    """FSDP's all-gathered parameters and unreduced gradients of the blocks being computed."""
    temporaries: int
    """Transient buffers outside autograd's saved set: one loss chunk's logits, their fp32 copy and
    gradient; a block's recomputation under activation checkpointing; CP attention's tile buffers."""
    host_activations: int = 0
    """Activations ``train.activation_offload`` keeps in host memory (all micro-batches in flight); ``activations``
    then counts what stays on the device: nothing the planner counts."""
    host_pinning: int = 0
    """What pinning adds in host memory on CUDA: torch's caching host allocator rounds each pinned request up to a power
    of two (``pinned_rounding_bytes``)."""
    state_on_host: bool = False
    """``fsdp.cpu_offload``: ``params``, ``grads`` and ``optimizer`` are in host memory, not on the device (FSDP's
    gathered compute copies stay in ``gathered``)."""
    grads_in_forward: int | None = None
    """Gradient bytes live while the activations peak (at the turn from forward to backward): none with one
    micro-batch a step (meshtron frees gradients after each update and backward makes them as it frees
    activations), ``grads`` when micro-batches accumulate. None: ``grads``."""
    reference: int = 0
    """A ``model`` reference's parameters (``preference.reference=model``: laid out like the policy, no gradients or
    optimizer state), held through the whole step."""
    reference_forward: int = 0
    """What a live reference's forward (``model`` or ``lora_base``, no_grad, before each micro-batch's policy forward)
    holds at once: one block's working set, its FSDP-gathered blocks, one chunk of the head's logits."""
    teacher: int = 0
    """A distillation teacher's parameters (``train.objective=distill``: laid out like the student with its own even
    pipeline split, in ``distill.teacher_dtype``, no gradients or optimizer state), held through the whole step."""
    teacher_hidden: int = 0
    """The teacher's final hidden states kept for the student's loss (its compute dtype, whole over tp): one
    micro-batch's, and under pipelining all of the last stage's microbatches' at once."""
    teacher_head: int = 0
    """The teacher's root parameters FSDP keeps gathered from its forward to the end of the student's loss (embedding,
    final norm, head; without FSDP under mixed precision the head's compute-dtype copy)."""
    teacher_forward: int = 0
    """What the teacher's forward (no_grad, before each micro-batch's student forward) holds at once: one block's
    working set, its FSDP-gathered blocks and root, or without FSDP its compute-dtype weight copies."""

    @property
    def host(self) -> int:
        """Bytes in host memory: offloaded activations, and the state (a teacher's parameters too, which FSDP offloads
        alike) under ``fsdp.cpu_offload``, as pinned."""
        on_host = self.state + self.teacher if self.state_on_host else 0
        return self.host_activations + on_host + self.host_pinning

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak_state(self) -> int:
        """The state on the device at the forward's end: parameters, optimizer state and the gradients held through
        the forward (none of it under ``fsdp.cpu_offload``)."""
        if self.state_on_host:
            return 0
        held = self.grads if self.grads_in_forward is None else self.grads_in_forward
        return self.params + self.optimizer + held + self.reference + self.teacher

    @property
    def total(self) -> int:
        """The device's peak: the largest of the forward's end (``peak_state``, activations, FSDP's buffers, the
        loss's temporaries and what the teacher leaves for the loss), the backward's end (parameters, optimizer state,
        FSDP's buffers and all gradients), a live reference's forward and a teacher's forward (``peak_state`` and
        what that forward holds)."""
        teacher_for_loss = self.teacher_hidden + self.teacher_head
        forward_end = self.peak_state + self.activations + self.gathered + self.temporaries + teacher_for_loss
        backward_end = (0 if self.state_on_host else self.state + self.teacher) + self.reference + self.gathered
        teacher_end = self.peak_state + self.teacher_forward + self.teacher_hidden
        return max(forward_end, backward_end, self.peak_state + self.reference_forward, teacher_end)


def stage_layout(
    shape: ModelShape, layout: Layout, workload: Workload | None = None
) -> list[list[tuple[int, bool, bool]]]:
    """Per pipeline rank: (layers, holds embeddings, holds head) of each stage it holds."""
    if layout.dims.pp == 1:
        return [[(shape.layers, True, True)]]
    from meshtron.distributed.pipeline_parallel import local_stage_ids, split_layers

    cfg = layout.parallel_config(workload)
    ranges = split_layers(shape.layers, cfg)
    last = len(ranges) - 1
    return [[(len(ranges[s]), s == 0, s == last) for s in local_stage_ids(r, cfg)] for r in range(layout.dims.pp)]


def _numel(specs, layout: Layout, shape: ModelShape) -> int:
    return sum(p.local_numel(layout.dims.tp, layout.fsdp_size, shape.kv_heads, layout.dims.ep) for p in specs)


def _final_specs(shape: ModelShape, first: bool, last: bool) -> tuple:
    """The parameters a stage holding the head holds besides its blocks and embeddings: the final norm and
    head, plus, for tied embeddings on a last stage without them (pp > 1), the head's own copy of them."""
    if not last:
        return ()
    return shape.final + (shape.embedding if shape.tied_embeddings and not first else ())


def state_numel(shape: ModelShape, layout: Layout, workload: Workload | None = None) -> list[int]:
    """Parameter elements held by each pipeline rank (the largest FSDP shard of it)."""
    embedding = _numel(shape.embedding, layout, shape)
    return [
        sum(
            shape.blocks_numel(layers, first, lambda specs: _numel(specs, layout, shape))
            + (embedding if first else 0)
            + _numel(_final_specs(shape, first, last), layout, shape)
            for layers, first, last in stages
        )
        for stages in stage_layout(shape, layout, workload)
    ]


def trained_numel(shape: ModelShape, layout: Layout, workload: Workload | None = None) -> list[int]:
    """Per pipeline rank: the parameter elements of ``state_numel`` that train (gradients, optimizer state): all of
    them, but under LoRA (``[lora]``) the adapters and a trained head / embeddings only."""
    trained = dataclasses.replace(
        shape,
        block=_trained(shape.block),
        dense_block=_trained(shape.dense_block),
        embedding=_trained(shape.embedding),
        final=_trained(shape.final),
    )
    return state_numel(trained, layout, workload)


def _trained(specs) -> tuple:
    """The parameters of ``specs`` that train (all but LoRA's frozen base)."""
    return tuple(p for p in specs if p.trained)


def optimizer_state_numel(workload: Workload, trained: int, matrices: int) -> int:
    """Optimizer-state elements of ``trained`` parameters, ``matrices`` of them stepped as block matrices (the
    registry entry's copies per parameter: AdamW 2; Muon 1 for its matrices, AdamW's 2 for the rest)."""
    entry = optimizer_entry(workload.optimizer)
    apart = 0 if entry.matrix_state_copies is None else (entry.matrix_state_copies - entry.state_copies) * matrices
    return entry.state_copies * trained + apart


def muon_numel(shape: ModelShape, layout: Layout, workload: Workload | None = None) -> list[int]:
    """Per pipeline rank: the parameter elements of ``state_numel`` that the optimizer steps as block matrices
    (its registry entry's ``matrix_state_copies``: Muon's, one momentum buffer each instead of AdamW's two moments);
    0 under an optimizer that steps none apart (AdamW)."""
    if workload is None or optimizer_entry(workload.optimizer).matrix_state_copies is None:
        return [0] * layout.dims.pp

    def numel(specs):
        return _numel([p for p in specs if p.muon], layout, shape)

    return [
        sum(shape.blocks_numel(layers, first, numel) for layers, first, _ in stages)
        for stages in stage_layout(shape, layout, workload)
    ]


def compute_bytes(workload: Workload) -> int:
    """Bytes of an activation element: the compute dtype, in every layout (``precision.mixed_precision``)."""
    return DTYPE_BYTES[workload.compute_dtype]


def casts_weights(layout: Layout, workload: Workload) -> bool:
    """Whether the forward computes with compute-dtype copies of the weights that autograd keeps: mixed
    precision without FSDP (FSDP's gathered parameters are counted in ``gathered`` instead)."""
    return not layout.dims.fsdp_applied(workload.cpu_offload) and workload.compute_dtype != workload.model_dtype


def head_tokens(layout: Layout, workload: Workload) -> int:
    """Tokens of one micro-batch on a rank (the loss sees this rank's sequence chunk)."""
    return layout.micro_batch * workload.seq_len // layout.dims.cp


def loss_chunked(layout: Layout, workload: Workload) -> bool:
    """Whether the loss cuts the head's tokens into chunks (``train.loss_chunk_size``)."""
    return 0 < workload.loss_chunk_size < head_tokens(layout, workload)


def fused_loss(workload: Workload) -> bool:
    """Whether the loss is meshtron's fused head + cross-entropy (``train.loss_chunk_size`` > 0, one chunk or many):
    each chunk's gradients are written in the forward pass and kept until backward, nothing is recomputed."""
    return workload.loss_chunk_size > 0


def fused_loss_vocab(shape: ModelShape, layout: Layout) -> int:
    """Vocabulary entries of the fused loss's logits on the busiest rank: the head's own tensor-parallel slice
    (the fused loss reduces its statistics over the split, with or without loss parallel)."""
    return -(-shape.vocab // layout.dims.tp)


def fused_loss_gradient_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> int:
    """The fused loss's float32 head-weight gradient, kept from its forward to its backward (a preference objective's
    head makes its own in backward: ``head_weight_gradient_bytes``; distillation's divergence, fused at any chunk
    size, writes it in its forward as the fused cross-entropy does)."""
    writes_in_forward = (fused_loss(workload) and not workload.preference) or workload.distill
    return head_weight_gradient_bytes(shape, layout) if writes_in_forward else 0


def head_weight_gradient_bytes(shape: ModelShape, layout: Layout) -> int:
    """The head's float32 weight gradient summed over the loss's chunks (this rank's vocabulary slice)."""
    return FP32 * fused_loss_vocab(shape, layout) * shape.hidden


def _local_numel(specs, layout: Layout, shape: ModelShape) -> int:
    """Elements of ``specs`` on one rank before FSDP sharding (what a compute-dtype copy or a gather holds):
    under expert parallelism only this rank's ``E / ep`` experts."""
    return sum(p.local_numel(layout.dims.tp, 1, shape.kv_heads, layout.dims.ep) for p in specs)


def head_numel(shape: ModelShape, layout: Layout) -> int:
    """The final norm and head (the embedding when tied) on one tensor-parallel rank."""
    return _local_numel(shape.final + (shape.embedding if shape.tied_embeddings else ()), layout, shape)


def _norm(hidden: int, e: int, frozen: bool = False) -> int:
    """An RMSNorm keeps its input upcast to fp32, 1/rms and its normalized output (before the weight), which a frozen
    weight (LoRA) needs no gradient from."""
    return FP32 * hidden + FP32 + (0 if frozen else e * hidden)


def compiled_elementwise(shape: ModelShape, workload: Workload) -> bool:
    """Whether a block's elementwise work is compiled (``train.compile``), for a block whose anatomy the compiled
    accounting covers (Llama-family attention and a dense gated MLP, LoRA adapters included; others keep the eager
    accounting)."""
    plain = not (shape.eager_attention or shape.kv_latent or shape.head_norms or shape.experts)
    return workload.compiled and plain and shape.gated_mlp


def block_activation_per_token(shape: ModelShape, layout: Layout, workload: Workload, dense: bool = False) -> float:
    """Bytes one decoder block keeps for backward per token of this rank's sequence chunk, no checkpointing;
    ``dense``: one of an MoE model's dense first layers (DeepSeek-V3's ``first_k_dense_replace``).

    Compiled blocks (``train.compile``, see compiled_elementwise): inductor's partitioner keeps what a matmul or
    attention needs and recomputes the elementwise rest in backward: each norm's input (compute dtype) and 1/rms
    instead of its fp32 upcast and normalized output, gate and up and their product (not SiLU(gate)), the
    attention output once (its copy for o_proj is recomputed). Under ``precision.float8`` the linears' inputs are not
    kept (see _compiled_block_per_token). Measured on one H100 (llama-1b b8: 23.17 GB kept; llama-8b tp=8
    rehearsal: 10.43 GB; meshtron.plan.calibration); eager blocks keep what Hugging Face's code saves."""
    if compiled_elementwise(shape, workload):
        return _compiled_block_per_token(shape, layout, workload)
    e, tp = compute_bytes(workload), layout.dims.tp
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    heads = shape.heads // tp
    kv_local = max(shape.kv_heads // tp, 1)
    kv_stored = shape.kv_heads // tp if shape.kv_heads >= tp else shape.kv_heads  # replicated KV: v is a view
    stream_split = tp if tp > 1 and layout.parallel.sequence_parallel else 1
    frozen = shape.frozen_norms
    norms = shape.residual_norms * _norm(h, e, frozen) / stream_split
    gathered_inputs = 2 * e * h  # attention and MLP inputs, whole sequence on every tp rank
    attention: float = e * (2 * heads * d + kv_local * d + kv_stored * d) + FP32 * heads  # q, k, v, out, log-sum-exp
    if layout.dims.cp > 1 and layout.parallel.cp_method in ("ulysses", "hybrid"):
        # After the all-to-all: heads / degree for degree times the tokens (Ulysses: the whole sequence; hybrid: its
        # group's, which its ring keeps), as many q / out bytes.
        degree = layout.parallel.cp_ulysses if layout.parallel.cp_method == "hybrid" else layout.dims.cp
        kv_received = max(kv_local, degree)  # KV heads repeated up to the all-to-all's degree when fewer
        attention = e * (2 * heads * d + 2 * kv_received * d) + FP32 * heads
    if meshtron_attention(layout, workload):
        attention += e * heads * d  # the output made contiguous for o_proj
        if dense_document_mask(layout, workload):
            # The mask, which SDPA turns into a float bias in every block: (S, S) per sequence, over S / cp tokens.
            attention += e * workload.seq_len * (layout.dims.cp if layout.parallel.cp_method == "ulysses" else 1)
    if shape.kv_latent:  # DeepSeek-V3's latent attention (meshtron.models.deepseek)
        attention += _latent_attention_extra(shape, layout, workload)
    if shape.head_norms:
        attention += _norm(heads * d, e, frozen) + _norm(kv_local * d, e, frozen)  # Qwen3's per-head q/k norms
    if shape.eager_attention:  # eager: k/v repeated to every query head, scores (and capped scores) kept, no lse
        attention += e * (2 * heads - kv_local - kv_stored) * d - FP32 * heads
        attention += e * heads * workload.seq_len * (1 + shape.attention_softcap)
    if shape.experts and not dense:  # a sparse MoE block, whole on every tp rank (meshtron.models.moe)
        mlp = moe_activation_per_token(shape, e, layout.dims.ep)
    elif tiled_mlp(workload):  # only the MLP's input, this rank's part of the sequence (activation_memory.tiled_mlp)
        mlp = e * h / stream_split - e * h  # instead of the gathered input that gate and up keep
    else:
        mlp = (4 if shape.gated_mlp else 2) * e * inter // tp  # gate, silu(gate), up, silu(gate) * up (or in, act(in))
    adapters = e * shape.adapter_ranks  # LoRA: each adapter's A x (whole on every tp rank, or a partial sum)
    return norms + gathered_inputs + attention + mlp + adapters


def _compiled_block_per_token(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """block_activation_per_token of a compiled Llama-family block."""
    e, tp = compute_bytes(workload), layout.dims.tp
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    heads = shape.heads // tp
    kv_local = max(shape.kv_heads // tp, 1)
    kv_stored = shape.kv_heads // tp if shape.kv_heads >= tp else shape.kv_heads
    stream_split = tp if tp > 1 and layout.parallel.sequence_parallel else 1
    # A linear's input, kept in the compute dtype for its weight gradient; under float8 not at all: the backward
    # casts its operands afresh anyway, and recomputes the float8 cast from what the block keeps (a norm's input
    # and 1/rms, gate and up) and the per-tensor scale.
    linear_in = 0 if workload.float8 else e
    norms = shape.residual_norms * (e * h + FP32) / stream_split  # each norm's input and 1/rms
    gathered_inputs = 2 * linear_in * h  # q/k/v's and gate/up's inputs, whole sequence on every tp rank
    attention: float = e * (2 * heads * d + kv_local * d + kv_stored * d) + FP32 * heads  # q, k, v, out, log-sum-exp
    if dense_document_mask(layout, workload):
        attention += e * workload.seq_len
    mlp: float = (2 * e + linear_in) * inter // tp  # gate, up, and down's input SiLU(gate) * up
    if tiled_mlp(workload):  # only the MLP's input (this rank's part), instead of gate and up's gathered input
        mlp = e * h / stream_split - linear_in * h
    adapters = e * shape.adapter_ranks  # LoRA: each adapter's A x
    return norms + gathered_inputs + attention + mlp + adapters


def _latent_attention_extra(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """What latent attention keeps per token beyond ``block_activation_per_token``'s q / k / v / out of ``head_dim``
    wide heads: its values are ``value_head_dim`` wide and views of the up-projection's whole output (no-rope keys
    and values), the output too; the latents (whole on every tp rank) keep their down-projections' outputs, their
    norms and the up-projections' inputs."""
    e, heads = compute_bytes(workload), shape.heads // layout.dims.tp
    d, v_dim = shape.head_dim, shape.value_head_dim or shape.head_dim
    outputs = 2 if meshtron_attention(layout, workload) else 1  # out, and its contiguous copy for o_proj
    heads_change = heads * ((shape.nope_dim + v_dim) - d) + outputs * heads * (v_dim - d)
    latents = sum(
        _norm(width, e, shape.frozen_norms) + e * width for width in (shape.q_latent, shape.kv_latent) if width
    )
    return e * heads_change + latents


def meshtron_attention(layout: Layout, workload: Workload) -> bool:
    from meshtron.models.attention import uses_meshtron_attention

    return uses_meshtron_attention(layout.dims.cp, workload.mask_documents)


def dense_document_mask(layout: Layout, workload: Workload) -> bool:
    """Whether whole-sequence attention takes a (B, 1, S, S) document mask: SDPA off CUDA (on CUDA,
    FlexAttention's block mask is negligible; ring / all-gather context parallelism builds per-tile masks, Ulysses
    attends whole sequences)."""
    whole_sequences = layout.dims.cp == 1 or layout.parallel.cp_method == "ulysses"
    return whole_sequences and workload.mask_documents and workload.device != "cuda"


def outer_activation_per_token(shape: ModelShape, layout: Layout, workload: Workload, first: bool, last: bool) -> float:
    """Bytes per token kept outside the blocks: token ids; the final norm, the head's input (the fused loss's
    hidden-state gradient instead, the same size) and labels; without the fused loss the fp32 log-softmax too."""
    e, tp = compute_bytes(workload), layout.dims.tp
    stream_split = tp if tp > 1 and layout.parallel.sequence_parallel else 1
    total = 0.0
    if first:
        total += INDEX  # token ids for the embedding's backward
    if last:
        total += (
            _norm(shape.hidden, e, shape.frozen_norms) / stream_split + e * shape.hidden + INDEX
        )  # norm, head, labels
        if not fused_loss(workload) and not workload.preference and not workload.distill:
            total += FP32 * loss_vocab(shape, layout) * (1 + shape.logit_softcap)  # log-softmax output, capped logits
        if not fused_loss(workload) and workload.distill:  # the unfused divergence's autograd graph, logits gathered
            total += FP32 * shape.vocab * (UNFUSED_DIVERGENCE_SAVED[workload.divergence] + shape.logit_softcap)
    return total


UNFUSED_DIVERGENCE_SAVED = {"forward_kl": 3, "reverse_kl": 4, "jsd": 8}
"""float32 ``tokens x vocab`` tensors autograd keeps for the unfused divergence's backward (``train.loss_chunk_size=0``;
measured with saved-tensor hooks on meshtron.train.loss.distill's unfused path, any alpha)."""


def loss_vocab(shape: ModelShape, layout: Layout) -> int:
    """Vocabulary entries of the logits on the busiest rank (split over tp under loss parallel; a vocabulary
    tp does not divide is split unevenly, the first ranks holding the ceiling)."""
    return -(-shape.vocab // layout.dims.tp) if layout.dims.tp > 1 and layout.parallel.loss_parallel else shape.vocab


def weight_copy_bytes(shape: ModelShape, layout: Layout, workload: Workload, layers: int, last: bool) -> int:
    """Compute-dtype weight copies one micro-batch keeps for backward (mixed precision without FSDP): each
    block's (unless checkpointed: recomputed), and the final norm's and head's on the last stage."""
    if not casts_weights(layout, workload):
        return 0
    numel = head_numel(shape, layout) if last else 0
    if layout.activation_checkpointing == "none":
        numel += layers * _local_numel(shape.block, layout, shape)
    return numel * compute_bytes(workload)


def tiled_mlp(workload: Workload) -> bool:
    """Whether ``train.mlp_tiles`` tiles the dense MLPs (meshtron.distributed.activation_memory.tiled_mlp): each keeps
    only its input."""
    return workload.mlp_tiles > 1


def checkpointed_block_per_token(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Bytes per token a checkpointed block keeps: its input (full) or its input and matmul/attention outputs
    (selective)."""
    e, tp = compute_bytes(workload), layout.dims.tp
    stream_split = tp if tp > 1 and layout.parallel.sequence_parallel else 1
    block_input = e * shape.hidden / stream_split
    if layout.activation_checkpointing == "full":
        return block_input
    heads, kv_local = shape.heads // tp, max(shape.kv_heads // tp, 1)
    matmuls = e * ((heads + 2 * kv_local) * shape.head_dim + 2 * shape.hidden + 3 * shape.intermediate // tp)
    return block_input + matmuls + e * heads * shape.head_dim + FP32 * heads


def chunks_in_flight(layout: Layout, workload: Workload, pp_rank: int) -> int:
    """Stage-microbatches whose activations a pipeline rank holds at its peak (1 without pipelining)."""
    if layout.dims.pp == 1:
        return 1
    m, pp, v = layout.microbatches(workload), layout.dims.pp, layout.stages_per_rank
    if layout.parallel.pp_schedule == "GPipe":
        return m
    if layout.parallel.pp_schedule == "1F1B":
        return min(m, pp - pp_rank)
    # Interleaved and zero-bubble schedules: the warm-up forwards of torch.distributed.pipelining.
    return min(m * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def activation_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Peak saved-for-backward bytes of each pipeline rank on the device (weight copies of mixed precision
    included). Under ``train.activation_offload`` only those weight copies, which the step holds anyway; the rest is in
    host memory (``host_activation_bytes``; tensors under 1 MiB and parameters stay too, which the planner leaves
    out)."""
    if workload.activation_offload:
        return _weight_copies_per_rank(shape, layout, workload)
    return saved_activation_bytes(shape, layout, workload)


def host_activation_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Peak bytes each pipeline rank holds in host memory under ``train.activation_offload`` (else none)."""
    if not workload.activation_offload:
        return [0.0] * layout.dims.pp
    saved = saved_activation_bytes(shape, layout, workload)
    return [s - w for s, w in zip(saved, _weight_copies_per_rank(shape, layout, workload))]


def _weight_copies_per_rank(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """The compute-dtype weight copies autograd keeps on each pipeline rank (mixed precision without FSDP)."""
    return [
        float(sum(weight_copy_bytes(shape, layout, workload, layers, last) for layers, _, last in stages))
        for stages in stage_layout(shape, layout, workload)
    ]


def kept_block_per_token(shape: ModelShape, layout: Layout, workload: Workload, dense: bool = False) -> float:
    """Bytes per token of this rank's chunk that one block keeps for backward, checkpointed or not; ``dense``: one of
    an MoE model's dense first layers (see block_activation_per_token)."""
    if layout.activation_checkpointing == "none":
        return block_activation_per_token(shape, layout, workload, dense=dense)
    return checkpointed_block_per_token(shape, layout, workload)


OFFLOADED_TENSORS_PER_BLOCK = 24
"""At most this many tensors a block saves that are offloaded apart without checkpointing (llama-tiny: 18; LoRA's
adapters add theirs); under full checkpointing one, its input."""

OFFLOADED_TENSORS_OUTSIDE_BLOCKS = 8
"""At most this many offloaded tensors saved outside the blocks per micro-batch (llama-tiny: 6: the embeddings' output,
the rotary tables, the final norm's and the loss's inputs)."""


def pinned_rounding_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Per pipeline rank, what pinning adds on CUDA to the bytes in host memory, at most: each offloaded activation
    takes its bytes rounded up to ``PINNED_TAIL_BYTES`` (meshtron.distributed.activation_memory.offload's
    ``pinned_piece_sizes``), and under ``fsdp.cpu_offload`` FSDP2 pins each parameter shard and each gradient shard
    in a request of its own, which torch's caching host allocator rounds up to a power of two
    (``pinned_state_rounding``)."""
    if workload.device != "cuda":
        return [0.0] * layout.dims.pp
    return [
        a + s
        for a, s in zip(offload_pinning_bytes(shape, layout, workload), pinned_state_rounding(shape, layout, workload))
    ]


def offload_pinning_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Per pipeline rank, under ``train.activation_offload``: what rounding each host copy up to ``PINNED_TAIL_BYTES``
    adds, at most, for the copies in flight at the peak (as ``saved_activation_bytes`` counts micro-batches)."""
    if not workload.activation_offload:
        return [0.0] * layout.dims.pp
    from meshtron.distributed.activation_memory.offload import PINNED_TAIL_BYTES

    per_block = 1 if layout.activation_checkpointing == "full" else OFFLOADED_TENSORS_PER_BLOCK
    ranks = []
    for rank, stages in enumerate(stage_layout(shape, layout, workload)):
        copies = [layers * per_block + OFFLOADED_TENSORS_OUTSIDE_BLOCKS for layers, _, _ in stages]
        in_flight = max(max(copies), sum(copies) / len(copies) * chunks_in_flight(layout, workload, rank))
        ranks.append(float(in_flight * PINNED_TAIL_BYTES))
    return ranks


def pinned_state_rounding(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Per pipeline rank: what FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` adds under ``fsdp.cpu_offload`` by
    pinning each parameter shard, and each gradient shard it copies to the host, in a request of its own: torch's
    caching host allocator rounds each up to a power of two (the optimizer state is not pinned)."""
    if not workload.cpu_offload:
        return [0.0] * layout.dims.pp
    element = DTYPE_BYTES[workload.model_dtype]

    def rounding(specs) -> int:
        added = 0
        for p in specs:
            nbytes = p.local_numel(layout.dims.tp, layout.fsdp_size, shape.kv_heads, layout.dims.ep) * element
            added += (_power_of_two_ceil(nbytes) - nbytes) * (1 + p.trained)
        return added

    embedding = rounding(shape.embedding)
    return [
        float(
            sum(
                shape.blocks_numel(layers, first, rounding)
                + (embedding if first else 0)
                + rounding(_final_specs(shape, first, last))
                for layers, first, last in stages
            )
        )
        for stages in stage_layout(shape, layout, workload)
    ]


def _power_of_two_ceil(nbytes: int) -> int:
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


OFFLOAD_BLOCKS_ON_DEVICE = 3
"""Blocks' worth of offloaded activations on the device at once in backward: the block being differentiated and
what is fetched ahead (meshtron.distributed.activation_memory.offload: twice the largest host copy)."""


def offload_traffic_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Bytes the busiest rank copies to the host in a step's forwards under ``train.activation_offload`` (as many
    come back in backward): each micro-batch's saved activations, on every stage the rank holds."""
    if not workload.activation_offload:
        return 0.0
    return max(
        sum(chunk for chunk in per_rank) * layout.microbatches(workload)
        for per_rank in _saved_per_chunk(shape, layout, workload)
    )


def saved_activation_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Peak saved-for-backward bytes of each pipeline rank, wherever they are kept."""
    return [
        max(max(per_chunk), sum(per_chunk) / len(per_chunk) * chunks_in_flight(layout, workload, rank))
        for rank, per_chunk in enumerate(_saved_per_chunk(shape, layout, workload))
    ]


def _saved_per_chunk(shape: ModelShape, layout: Layout, workload: Workload) -> list[list[float]]:
    """Per pipeline rank, per stage it holds: the bytes one micro-batch keeps for backward."""
    tokens = head_tokens(layout, workload)
    per_block = kept_block_per_token(shape, layout, workload)
    per_dense_block = kept_block_per_token(shape, layout, workload, dense=True)
    ranks = []
    for stages in stage_layout(shape, layout, workload):
        per_chunk = [
            tokens
            * (
                (layers - shape.dense_layers_of(layers, first)) * per_block
                + shape.dense_layers_of(layers, first) * per_dense_block
                + outer_activation_per_token(shape, layout, workload, first, last)
            )
            + weight_copy_bytes(shape, layout, workload, layers, last)
            + (fused_loss_gradient_bytes(shape, layout, workload) if last else 0)
            for layers, first, last in stages
        ]
        ranks.append(per_chunk)
    return ranks


def ddp_replication(layout: Layout, workload: Workload) -> bool:
    """Data parallelism meshtron runs with DDP instead of ``fully_shard`` (``data_parallel.replicates_only``):
    replicas only (no dp_shard, cp, tp or pp) computing in the weights' own dtype, without ``fsdp.cpu_offload``."""
    return (
        not workload.cpu_offload
        and layout.fsdp_size == 1
        and layout.dims.tp == 1
        and layout.dims.pp == 1
        and workload.compute_dtype == workload.model_dtype == "float32"
    )


def defers_gradient_reduction(layout: Layout, workload: Workload) -> bool:
    """Whether FSDP holds full-size gradients across a step's microbatches and reduce-scatters them once:
    under ``fsdp.accumulate_unsharded`` with accumulation, and always under pipeline parallelism
    (torch.distributed.pipelining reduce-scatters a stage's gradients after its last microbatch)."""
    sharded = layout.dims.fsdp_applied(workload.cpu_offload)
    if not sharded or ddp_replication(layout, workload) or layout.microbatches(workload) <= 1:
        return False
    return layout.dims.pp > 1 or workload.accumulate_unsharded


def held_gradient_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[float]:
    """Per pipeline rank: gradient bytes held between the microbatches of a step. The gradient shards
    (model dtype), or, when FSDP defers the reduction, the full tensor-parallel-local gradients in the
    reduce dtype (``fsdp.reduce_dtype``, fp32 by default)."""
    if not defers_gradient_reduction(layout, workload):
        return [numel * DTYPE_BYTES[workload.model_dtype] for numel in trained_numel(shape, layout, workload)]
    embedding = _local_numel(_trained(shape.embedding), layout, shape)
    return [
        sum(
            shape.blocks_numel(layers, first, lambda specs: _local_numel(_trained(specs), layout, shape))
            + embedding * first
            + _local_numel(_trained(_final_specs(shape, first, last)), layout, shape)
            for layers, first, last in stages
        )
        * FP32
        for stages in stage_layout(shape, layout, workload)
    ]


def gathered_bytes(shape: ModelShape, layout: Layout, workload: Workload, stages) -> float:
    """FSDP's unsharded compute-dtype parameters and one block's unreduced fp32 gradient on a rank. Blocks
    are resharded after forward (two gathered at a time: the one computing, the one prefetched), except
    under pipelining, where a stage keeps all of its blocks gathered for the step; the root's parameters
    (embeddings, final norm, head) stay gathered. Nothing under plain replication (run by DDP)."""
    if not layout.dims.fsdp_applied(workload.cpu_offload) or ddp_replication(layout, workload):
        return 0.0
    e = compute_bytes(workload)
    block = _local_numel(shape.block, layout, shape)
    layers = sum(n for n, _, _ in stages) if layout.dims.pp > 1 else 2
    outer = sum(
        _local_numel(shape.embedding, layout, shape) * first
        + _local_numel(_final_specs(shape, first, last), layout, shape)
        for _, first, last in stages
    )
    trained_block = _local_numel(_trained(shape.block), layout, shape)
    unreduced = 0 if defers_gradient_reduction(layout, workload) else trained_block * FP32  # else in held gradients
    return layers * block * e + unreduced + outer * e


def logits_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """The loss's transient logits on the rank with the head. Fused: one chunk's compute-dtype logits, their fp32
    copy (exponentiated in place; soft-capping keeps one more) and their compute-dtype gradient. Unfused: all
    tokens' logits, their fp32 copy and fp32 gradient. A preference objective's head
    (meshtron.train.loss.token_logps) recomputes one chunk in backward, as the fused loss computes one (its chunk:
    ``train.loss_chunk_size``, 0 meaning all tokens), and sums the head's float32 weight gradient there."""
    tokens = head_tokens(layout, workload)
    e = compute_bytes(workload)
    if workload.distill:
        return divergence_logits_bytes(shape, layout, workload)
    if workload.preference:
        chunk = min(tokens, workload.loss_chunk_size or tokens)
        logits = chunk * fused_loss_vocab(shape, layout) * (2 * e + FP32 * (1 + shape.logit_softcap))
        return logits + head_weight_gradient_bytes(shape, layout)
    if fused_loss(workload):
        chunk = min(tokens, workload.loss_chunk_size)
        return chunk * fused_loss_vocab(shape, layout) * (2 * e + FP32 * (1 + shape.logit_softcap))
    return tokens * loss_vocab(shape, layout) * (e + 2 * FP32)


def reference_shape(shape: ModelShape) -> ModelShape:
    """The model a ``model`` reference copies: the policy's parameters without LoRA's adapters."""
    from meshtron.models.lora import is_lora_parameter

    def base(specs) -> tuple:
        return tuple(p for p in specs if not is_lora_parameter(p.name))

    return dataclasses.replace(
        shape,
        block=base(shape.block),
        dense_block=base(shape.dense_block),
        embedding=base(shape.embedding),
        final=base(shape.final),
    )


def reference_param_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> list[int]:
    """Per pipeline rank: a ``model`` reference's parameter bytes, sharded as the policy is (FSDP, TP, PP stages), in
    ``preference.reference_dtype``; 0 for every other reference."""
    if workload.reference != "model":
        return [0] * layout.dims.pp
    numels = state_numel(reference_shape(shape), layout, workload)
    return [numel * workload.reference_bytes_per_param for numel in numels]


def reference_forward_bytes(shape: ModelShape, layout: Layout, workload: Workload, stages) -> float:
    """What a live reference's forward holds at once on a rank holding ``stages`` (under no_grad nothing is kept
    for backward): one block's working set (bounded by what a block keeps for backward), the reference's blocks
    FSDP gathers (its ``gathered_bytes``, no gradients), the head's one chunk of logits, and without FSDP under mixed
    precision the reference's compute-dtype weight copies (released after its forward); 0 without one."""
    if not workload.live_reference:
        return 0.0
    model = reference_shape(shape) if workload.reference == "model" else shape
    plain = dataclasses.replace(layout, activation_checkpointing="none")
    tokens = head_tokens(layout, workload)
    working = tokens * block_activation_per_token(model, plain, workload)
    frozen = dataclasses.replace(model, block=tuple(dataclasses.replace(p, trained=False) for p in model.block))
    gathered = gathered_bytes(frozen, layout, workload, stages)
    holds_head = any(last for _, _, last in stages)
    logits = logits_bytes(model, layout, workload) - head_weight_gradient_bytes(model, layout) if holds_head else 0.0
    copies = 0.0
    if casts_weights(layout, workload):
        layers = sum(n for n, _, _ in stages)
        copies = (layers * _local_numel(model.block, layout, model) + head_numel(model, layout)) * compute_bytes(
            workload
        )
    return working + gathered + logits + copies


def divergence_logits_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Distillation's fused chunked divergence on the rank with the heads: per chunk of tokens
    (``train.loss_chunk_size``, 0 meaning all of them) both heads' logits over this rank's vocabulary slice at once,
    each in its compute dtype and as float32, with each one's float32 probabilities, and the student's compute-dtype
    gradient (soft-capping keeps one more float32 copy per capped head); the fused cross-entropy holds one head's."""
    teacher = workload.teacher.shape
    tokens = head_tokens(layout, workload)
    chunk = min(tokens, workload.loss_chunk_size or tokens)
    e, teacher_e = compute_bytes(workload), DTYPE_BYTES[workload.teacher_compute_dtype]
    per_logit = 2 * e + teacher_e + FP32 * (4 + shape.logit_softcap + teacher.logit_softcap)
    return chunk * fused_loss_vocab(shape, layout) * per_logit


def teacher_workload(workload: Workload) -> Workload:
    """The workload as the teacher runs it: its own storage dtype and compute dtype (``teacher_compute_dtype``)."""
    return dataclasses.replace(
        workload,
        model_dtype=workload.teacher_storage_dtype,
        compute_dtype=workload.teacher_compute_dtype,
    )


def teacher_param_bytes(layout: Layout, workload: Workload) -> list[int]:
    """Per pipeline rank: a distillation teacher's parameter bytes, sharded as the student's are (FSDP over
    ``dp_shard x cp``, TP, EP for experts) over its own even split into the same pipeline stages, in
    ``distill.teacher_dtype``; 0 without a teacher."""
    if workload.teacher is None:
        return [0] * layout.dims.pp
    numels = state_numel(workload.teacher.shape, layout.teacher_layout(), workload)
    return [numel * workload.teacher_bytes_per_param for numel in numels]


def teacher_hidden_bytes(layout: Layout, workload: Workload, holds_head: bool) -> int:
    """The teacher's final hidden states the rank with the head keeps for the student's loss: ``(rows, S / cp, H)``
    in the teacher's compute dtype, whole over tp; the rows are one micro-batch's, or under pipelining the rank's
    whole local batch (the teacher's pipeline runs all microbatches before the student's)."""
    if workload.teacher is None or not holds_head:
        return 0
    rows = layout.local_batch(workload) if layout.dims.pp > 1 else layout.micro_batch
    tokens = rows * workload.seq_len // layout.dims.cp
    return tokens * workload.teacher.shape.hidden * DTYPE_BYTES[workload.teacher_compute_dtype]


def teacher_head_bytes(layout: Layout, workload: Workload, stages) -> int:
    """The teacher's root parameters gathered from its forward to the end of the student's loss on a rank holding the
    teacher's ``stages``: under FSDP its embedding, final norm and head (compute dtype, this tp rank's slice);
    without FSDP under mixed precision the final norm's and head's compute-dtype copies; else nothing."""
    teacher, own, run = workload.teacher.shape, layout.teacher_layout(), teacher_workload(workload)
    if own.dims.fsdp_applied(run.cpu_offload) and not ddp_replication(own, run):
        numel = sum(
            _local_numel(teacher.embedding, own, teacher) * first
            + _local_numel(_final_specs(teacher, first, last), own, teacher)
            for _, first, last in stages
        )
    elif casts_weights(own, run) and any(last for _, _, last in stages):
        numel = head_numel(teacher, own)
    else:
        numel = 0
    return numel * compute_bytes(run)


def teacher_forward_bytes(layout: Layout, workload: Workload, stages) -> float:
    """What the teacher's forward holds at once on a rank holding the teacher's ``stages`` (no_grad: nothing kept for
    backward; the head waits for the divergence): one block's working set (bounded by what a block keeps for
    backward), its blocks and root FSDP gathers (``gathered_bytes``, no gradients), and without FSDP under mixed
    precision its blocks' compute-dtype weight copies."""
    teacher, run = workload.teacher.shape, teacher_workload(workload)
    plain = dataclasses.replace(layout.teacher_layout(), activation_checkpointing="none")
    working = head_tokens(plain, run) * block_activation_per_token(teacher, plain, run)
    frozen = dataclasses.replace(teacher, block=tuple(dataclasses.replace(p, trained=False) for p in teacher.block))
    gathered = gathered_bytes(frozen, plain, run, stages)
    copies = 0
    if casts_weights(plain, run):
        copies = sum(n for n, _, _ in stages) * _local_numel(teacher.block, plain, teacher) * compute_bytes(run)
    return working + gathered + copies


def teacher_per_pipeline_rank(layout: Layout, workload: Workload) -> list[dict[str, int]]:
    """Per pipeline rank: the teacher's ``MemoryEstimate`` terms (``teacher``, ``teacher_hidden``, ``teacher_head``,
    ``teacher_forward``); all 0 without a teacher."""
    if workload.teacher is None:
        return [{} for _ in range(layout.dims.pp)]
    stages_per_rank = stage_layout(workload.teacher.shape, layout.teacher_layout(), workload)
    return [
        {
            "teacher": params,
            "teacher_hidden": teacher_hidden_bytes(layout, workload, any(last for _, _, last in stages)),
            "teacher_head": teacher_head_bytes(layout, workload, stages),
            "teacher_forward": int(teacher_forward_bytes(layout, workload, stages)),
        }
        for stages, params in zip(stages_per_rank, teacher_param_bytes(layout, workload))
    ]


def estimate_memory(shape: ModelShape, layout: Layout, workload: Workload) -> MemoryEstimate:
    """Memory of the busiest rank of ``layout`` (the pipeline rank with the most bytes)."""
    return max(memory_per_pipeline_rank(shape, layout, workload), key=lambda m: m.total)


def memory_per_pipeline_rank(shape: ModelShape, layout: Layout, workload: Workload) -> list[MemoryEstimate]:
    """Memory of a rank of each pipeline rank of ``layout`` (one entry without pipeline parallelism)."""
    state_bytes = DTYPE_BYTES[workload.model_dtype]
    tokens = head_tokens(layout, workload)
    temporaries = 0.0
    if layout.activation_checkpointing != "none":  # one block recomputed
        temporaries += tokens * block_activation_per_token(shape, layout, workload)
    if workload.activation_offload:  # the offloaded activations of the blocks differentiated or fetched ahead
        temporaries += OFFLOAD_BLOCKS_ON_DEVICE * tokens * kept_block_per_token(shape, layout, workload)
    casts_per_step = casts_weights(layout, workload) and layout.activation_checkpointing != "none"
    # Without FSDP the compute-dtype weight copies are made once per optimizer step and held through it
    # (meshtron.distributed.precision.ComputeWeights); autograd keeps them anyway unless blocks are checkpointed.
    if layout.dims.ep > 1:  # one MoE layer's dispatch: the rows sent and the rows received before regrouping
        temporaries += 2 * tokens * ep_rows_per_token(shape) * shape.hidden * compute_bytes(workload)
    if layout.dims.cp > 1:
        ring, heads = layout.dims.cp, shape.heads // layout.dims.tp
        if (
            layout.parallel.cp_method == "hybrid"
        ):  # the ring across the groups: chunks cp_ulysses times longer, fewer heads
            ring, heads = layout.dims.cp // layout.parallel.cp_ulysses, heads // layout.parallel.cp_ulysses
        chunk = workload.seq_len / (2 * ring)
        query_rows = layout.micro_batch * heads * chunk
        if workload.device == "cuda":
            # fused tile kernels (flash, FlexAttention): a few fp32 (query chunk x head dim) buffers of a
            # tile's output, merge and gradients, never its (chunk x chunk) scores
            temporaries += 4 * FP32 * query_rows * shape.head_dim
        else:
            # one (query chunk, key chunk) tile's fp32 scores, probabilities and their gradient
            temporaries += 3 * FP32 * query_rows * chunk
    logits = logits_bytes(shape, layout, workload)
    accumulates = layout.microbatches(workload) > 1  # gradients held from the second micro-batch's forward on
    estimates = []
    per_rank = zip(
        stage_layout(shape, layout, workload),
        state_numel(shape, layout, workload),
        activation_bytes(shape, layout, workload),
        host_activation_bytes(shape, layout, workload),
        pinned_rounding_bytes(shape, layout, workload),
        held_gradient_bytes(shape, layout, workload),
        muon_numel(shape, layout, workload),
        trained_numel(shape, layout, workload),
    )
    references = reference_param_bytes(shape, layout, workload)
    teachers = teacher_per_pipeline_rank(layout, workload)
    for (stages, numel, acts, host_acts, pinning, held_grads, muon, trained), reference, teacher in zip(
        per_rank, references, teachers
    ):
        holds_head = any(last for _, _, last in stages)
        copies = (
            sum(layers for layers, _, _ in stages) * _local_numel(shape.block, layout, shape) if casts_per_step else 0
        )
        grads = int(max(trained * state_bytes, held_grads))
        estimates.append(
            MemoryEstimate(
                params=numel * state_bytes,
                grads=grads,
                optimizer=optimizer_state_numel(workload, trained, muon) * state_bytes,
                activations=int(acts),
                host_activations=int(host_acts),
                host_pinning=int(pinning),
                state_on_host=workload.cpu_offload,
                gathered=int(gathered_bytes(shape, layout, workload, stages)),
                temporaries=int(temporaries + (logits if holds_head else 0) + copies * compute_bytes(workload)),
                grads_in_forward=grads if accumulates else 0,
                reference=reference,
                reference_forward=int(reference_forward_bytes(shape, layout, workload, stages)),
                **teacher,
            )
        )
    return estimates


def config_view(cfg, world_size: int, device: str = "cuda", hf_config=None) -> tuple[ModelShape, Layout, Workload]:
    """The planner's inputs for a meshtron config run on ``world_size`` processes on ``device``; ``hf_config``: the
    run's model config where the caller has it (else loaded from ``cfg``)."""
    if hf_config is None:
        from meshtron.data.hub import model_folder
        from meshtron.data.tokenizer import load_tokenizer
        from meshtron.models.build import load_hf_config

        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code, model_folder(cfg.model))
        hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    return (
        ModelShape.from_hf_config(hf_config, cfg.model, cfg.lora),
        Layout.from_config(cfg, world_size, hf_config),
        Workload.from_config(cfg, device),
    )


def param_bytes_of_rank(shape: ModelShape, layout: Layout, workload: Workload, rank: int) -> int:
    """Parameter bytes the planner expects global rank ``rank`` to hold (pp is the outermost mesh dim)."""
    pp_rank = rank // (layout.dims.world_size // layout.dims.pp)
    return state_numel(shape, layout, workload)[pp_rank] * DTYPE_BYTES[workload.model_dtype]


def teacher_bytes_of_rank(layout: Layout, workload: Workload, rank: int) -> int:
    """The teacher's parameter bytes the planner expects global rank ``rank`` to hold (0 without a teacher)."""
    pp_rank = rank // (layout.dims.world_size // layout.dims.pp)
    return teacher_param_bytes(layout, workload)[pp_rank]


def planned_teacher_bytes(cfg, world_size: int, rank: int, hf_config=None) -> int:
    """The planner's bytes of a ``train.objective=distill`` teacher's parameters on global rank ``rank`` of a
    ``world_size``-rank run of ``cfg`` (a meshtron Config; 0 for other objectives): what the run measures as
    ``TrainResult.teacher_bytes``. ``hf_config``: the student's model config where the caller has it."""
    _, layout, workload = config_view(cfg, world_size, "cpu", hf_config)
    return teacher_bytes_of_rank(layout, workload, rank)


def ep_rows_per_token(shape: ModelShape) -> int:
    """Hidden rows expert parallelism dispatches per token of a rank: one per routed expert (top-k; dropless,
    every (token, expert) pair is sent, to this rank too when it owns the expert)."""
    return shape.experts_per_token


def moe_activation_per_token(shape: ModelShape, e: int, ep: int = 1) -> float:
    """A sparse MoE block per token (a rank's tokens; uniform routing: under expert parallelism a rank receives as
    many (token, expert) pairs as it sends). Per pair, without EP (transformers' grouped experts): the gathered
    input, gate/up output, silu(gate), product and expert output, its routing weight and three int64 indices
    (token, slot, sort order). With EP (meshtron.distributed.expert_parallel) the received rows regrouped by
    expert (the experts' input), gate/up output, silu(gate) and product, on the receiving side, with the
    regrouping's two int64 permutations; on the sending side the returned rows (``combine``'s multiply keeps
    them), the routing weight and two int64 indices (sort order and its inverse): one int64 more per pair than
    without EP. Per token: the router's fp32 probabilities, its top-k int64 indices and fp32 weights and their
    sum; a shared expert's gated MLP, output and gate."""
    h, inter = shape.hidden, shape.moe_intermediate
    if ep > 1:
        pair = e * (2 * h + 4 * inter) + e + 4 * INDEX
    else:
        pair = e * (2 * h + 4 * inter) + e + 3 * INDEX
    router = FP32 * shape.experts + shape.experts_per_token * (INDEX + FP32) + FP32
    shared = e * (4 * shape.shared_expert_intermediate + h + 1) if shape.shared_expert_intermediate else 0
    return shape.experts_per_token * pair + router + shared
