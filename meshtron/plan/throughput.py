"""Step time of a layout: matmul FLOPs at a fraction of the device's peak, plus the communication that
compute does not hide, each collective costed by an alpha-beta model over NVLink or the network.

Mesh order is (pp, dp_replicate, dp_shard, cp, tp) with tp innermost, so a group of the ranks of one
dim spans ``size x (product of the inner degrees)`` consecutive ranks: inside a node when that is at
most ``gpus_per_node``, across nodes otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.metrics.flops import flops_per_token
from meshtron.plan import calibration
from meshtron.plan.hardware import Hardware
from meshtron.plan.layout import DTYPE_BYTES, Layout, Workload
from meshtron.plan.memory import (
    FP32,
    INDEX,
    compute_bytes,
    ep_rows_per_token,
    offload_traffic_bytes,
    stage_layout,
    state_numel,
    trained_numel,
)
from meshtron.plan.model_shape import ModelShape
from meshtron.train.optim.registry import optimizer_entry

HOST_ADAMW_BYTES_PER_PARAM = 28
"""AdamW on the host (``fsdp.cpu_offload``): fp32 parameter, gradient and two moments read, three written."""


@dataclass(frozen=True)
class StepEstimate:
    seconds: float
    compute_s: float
    """Matmul time including recomputation (checkpointed blocks, loss chunks' head) and the pipeline bubble."""
    exposed_comm_s: float
    """Communication on the critical path (TP, EP all-to-alls, un-hidden CP / FSDP / HSDP, pipeline transfers)."""
    tokens_per_s: float
    mfu: float
    """The model's training FLOPs (6 x parameters + attention, LoRA's change) over the step at the compute dtype's
    peak: what is trained only, so a live reference's or a distillation teacher's forward (time the step spends) and
    a preference head's second matmul are not counted in it."""
    all_to_all_s: float = 0.0
    """Expert parallelism's all-to-alls (token dispatch and combine, forward and backward), part of
    ``exposed_comm_s``; 0 without EP."""
    optimizer_s: float = 0.0
    """Muon's step (``optimizer.name=muon``): gathering sharded matrices and their Newton-Schulz iterations, on the
    critical path; 0 under AdamW (whose step is part of ``compute_s``: ``kernels.parameters``)."""
    offload_s: float = 0.0
    """The copies of ``train.activation_offload`` that compute does not hide (part of ``exposed_comm_s``)."""
    kernels: "KernelTimes | None" = None
    """A compiled step's kernels by kind (compiled steps on CUDA; None for eager steps, whose compute is the whole
    step's FLOPs at ``Hardware.matmul_efficiency``)."""


def _collective_s(nbytes: float, group: int, span: int, hw: Hardware, factor: float = 1.0) -> float:
    """Ring all-gather / reduce-scatter of ``nbytes`` (whole buffer) over ``group`` ranks spanning ``span``
    consecutive ranks; ``factor`` 2 for an all-reduce."""
    if group <= 1:
        return 0.0
    inside = span <= hw.gpus_per_node
    bandwidth = (hw.nvlink_gbps if inside else hw.network_gbps) * 1e9 * hw.link_efficiency
    latency = (hw.nvlink_latency_us if inside else hw.network_latency_us) * 1e-6
    return factor * ((group - 1) / group * nbytes / bandwidth + (group - 1) * latency)


def expert_all_to_all_s(
    shape: ModelShape, layout: Layout, workload: Workload, hw: Hardware, passes: int, layers: int, forwards: int
) -> float:
    """Expert parallelism's all-to-alls of one step on a rank: per MoE layer and micro-batch, the dispatch and
    the combine in every forward (a checkpointed block's recomputation included: ``passes - 1`` forwards) and
    again in backward (their gradients), each moving ``tokens x top-k x hidden x compute bytes`` of which the
    ``(ep - 1) / ep`` owned by other ranks leave (uniform routing: a rank's pairs spread evenly over the ep
    ranks, and it receives as many as it sends), plus each forward's exchange of the per-expert counts. Every
    tp rank of an ep group runs its own (ep is innermost in ``dp_shard x cp``, outside tp): the group spans
    ``ep x tp`` ranks. Nothing overlaps them (meshtron waits for each before computing). One all-to-all costs
    what ``_collective_s`` charges a ring collective: each rank sends the ``(ep - 1) / ep`` of its buffer owned by
    the others, ``ep - 1`` latencies, all of it over the network once the group leaves a node."""
    if layout.dims.ep <= 1 or not shape.experts:
        return 0.0
    rows = _dispatched_bytes(shape, layout, workload)
    span = layout.dims.ep * layout.dims.tp
    forward_passes = passes - 1
    one_layer = 2 * passes * _collective_s(rows, layout.dims.ep, span, hw)
    one_layer += forward_passes * _collective_s(shape.experts * INDEX, layout.dims.ep, span, hw)
    return one_layer * layers * forwards


def ulysses_all_to_all_s(
    shape: ModelShape,
    layout: Layout,
    workload: Workload,
    hw: Hardware,
    passes: int,
    layers: int,
    forwards: int,
    degree: int | None = None,
) -> float:
    """Ulysses context parallelism's all-to-alls of one step on a rank: per layer and micro-batch, q, k and v to head
    shards and the output back in every forward (a checkpointed block's recomputation included), and their gradients
    the other way in backward: four all-to-alls per pass, on the critical path (attention waits for them). k and v
    carry the rank's KV heads, repeated up to ``degree`` heads when fewer. ``degree``: the all-to-all's ranks, ``cp``
    (or ``cp_ulysses`` under ``cp_method=hybrid``: consecutive cp ranks); the group spans ``degree x tp`` ranks."""
    degree = degree or layout.dims.cp
    e = compute_bytes(workload)
    tokens = layout.micro_batch * workload.seq_len / layout.dims.cp
    heads, kv = shape.heads // layout.dims.tp, max(max(shape.kv_heads // layout.dims.tp, 1), degree)
    span = degree * layout.dims.tp
    q_bytes, kv_bytes = tokens * heads * shape.head_dim * e, tokens * kv * shape.head_dim * e
    one_pass = 2 * _collective_s(q_bytes, degree, span, hw) + 2 * _collective_s(kv_bytes, degree, span, hw)
    return one_pass * passes * layers * forwards


def _dispatched_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """The hidden rows one rank dispatches per MoE layer and micro-batch (each token once per routed expert)."""
    tokens = layout.micro_batch * workload.seq_len / layout.dims.cp
    return tokens * ep_rows_per_token(shape) * shape.hidden * compute_bytes(workload)


def expert_all_to_all_bytes(shape: ModelShape, layout: Layout, workload: Workload) -> float:
    """Bytes one rank sends to the other EP ranks per MoE layer and micro-batch, forward and backward (dispatch and
    combine in each; no recomputation), under uniform routing; 0 without EP."""
    if layout.dims.ep <= 1 or not shape.experts:
        return 0.0
    return 4 * _dispatched_bytes(shape, layout, workload) * (layout.dims.ep - 1) / layout.dims.ep


def preference_flops_per_token(hf_config, workload: Workload) -> float:
    """Matmul FLOPs per token a preference objective adds to ``flops_per_token``'s: its head
    (meshtron.train.loss.token_logps) computes each chunk's logits again in backward (one more head matmul), and a
    live reference (``model`` or ``lora_base``) runs the model's forward (a third of its training FLOPs) before each
    micro-batch."""
    if not workload.preference:
        return 0.0
    head = 2 * hf_config.hidden_size * hf_config.vocab_size
    reference = flops_per_token(hf_config, workload.seq_len) / 3 if workload.live_reference else 0.0
    return head + reference


def teacher_flops_per_token(workload: Workload) -> float:
    """Matmul FLOPs per token a distillation teacher adds to ``flops_per_token``'s: its forward (2 x its matmul
    parameters and attention, a third of its training FLOPs), whose head's matmul runs in the student's divergence
    (meshtron.metrics.flops counts the head among the matmuls); 0 without a teacher."""
    if workload.teacher is None:
        return 0.0
    return flops_per_token(workload.teacher.hf_config, workload.seq_len) / 3


def teacher_forward_comm_s(layout: Layout, workload: Workload, hw: Hardware) -> float:
    """The teacher's forwards' communication on the critical path of one step: tensor parallelism's collectives of
    each of its blocks (one pass) and under pipelining its hidden states sent on at each stage boundary; its FSDP
    all-gathers are with the student's (``fsdp_s``) and its ring exchanges hide behind its attention."""
    if workload.teacher is None:
        return 0.0
    teacher, e = workload.teacher.shape, DTYPE_BYTES[workload.teacher_compute_dtype]
    forwards = layout.microbatches(workload)
    layers = max(sum(n for n, _, _ in stages) for stages in stage_layout(teacher, layout.teacher_layout(), workload))
    nbytes = layout.micro_batch * workload.seq_len / layout.dims.cp * teacher.hidden * e
    sequence_parallel = layout.parallel.sequence_parallel
    one = _collective_s(nbytes, layout.dims.tp, layout.dims.tp, hw, 1.0 if sequence_parallel else 2.0)
    tp_s = one * (4 if sequence_parallel else 2) * layers * forwards
    pp_s = 0.0
    if layout.dims.pp > 1:
        pp_s = _collective_s(nbytes * 2, 2, layout.dims.world_size, hw) * forwards * layout.stages_per_rank
    return tp_s + pp_s


def fsdp_shard_groups(shape: ModelShape, layout: Layout, workload: Workload) -> list[tuple[int, int]]:
    """``(elements, ranks)`` of the busiest rank's FSDP shard: its non-expert parameters over ``dp_shard x cp``, its
    experts' over ``efsdp``."""
    shard = max(state_numel(shape, layout, workload))
    expert = expert_shard_numel(shape, layout, workload) if layout.dims.ep > 1 else 0
    return [(shard - expert, layout.fsdp_size), (expert, layout.efsdp_size)]


def bubble_fraction(layout: Layout, workload: Workload) -> float:
    """Idle fraction added to a pipeline rank's compute: (pp - 1) / (microbatches x stages per rank),
    a third of that for the zero-bubble schedules (their weight-gradient work fills most of it)."""
    if layout.dims.pp == 1:
        return 0.0
    bubble = (layout.dims.pp - 1) / (layout.microbatches(workload) * layout.stages_per_rank)
    if "ZeroBubble" in layout.parallel.pp_schedule:
        bubble /= 3
    if layout.parallel.pp_schedule == "GPipe":
        bubble = (layout.dims.pp - 1) / layout.microbatches(workload)
    return bubble


def estimate_step(shape: ModelShape, layout: Layout, workload: Workload, hw: Hardware, hf_config) -> StepEstimate:
    world = layout.dims.world_size
    tokens = workload.global_batch * workload.seq_len
    # Under LoRA: what the run computes (frozen weights take no weight gradient; the adapters add theirs).
    model_flops = (flops_per_token(hf_config, workload.seq_len) + shape.lora_flops_per_token) * tokens / world
    recompute = {"none": 1.0, "selective": 1.05, "full": 4 / 3}[layout.activation_checkpointing]
    if workload.mlp_tiles > 1:  # each tiled MLP runs its forward once more, in backward (activation_memory.tiled_mlp)
        mlp_forward = 2 * (3 if shape.gated_mlp else 2) * shape.hidden * shape.intermediate * shape.layers
        recompute += mlp_forward * tokens / world / model_flops
    e = compute_bytes(workload)  # every layout computes in the compute dtype (precision.mixed_precision)
    peak = (hw.peak_tflops if e == 2 else hw.fp32_tflops) * 1e12
    efficiency = hw.compiled_matmul_efficiency if workload.compiled else hw.matmul_efficiency
    # Small matmuls (few tokens per forward on a rank) run further from peak: a fixed cost per kernel.
    efficiency *= matmul_size_factor(layout, workload)
    # meshtron's context-parallel attention runs fused tile kernels on CUDA (flash, FlexAttention): the
    # compute-dtype rate, as without cp (the one extra forward of document-masked tiles in backward is
    # left out, as is document sparsity). Elsewhere its masked tiles are plain fp32 matmuls: the fp32 rate.
    width = (shape.head_dim + (shape.value_head_dim or shape.head_dim)) / 2  # scores by q / k, outputs by v width
    attention_flops = 3 * 2 * 2 * workload.seq_len * shape.heads * width / 2 * shape.layers * tokens / world
    attention_peak = peak if workload.device == "cuda" else hw.fp32_tflops * 1e12
    ulysses = (
        layout.dims.cp > 1 and layout.parallel.cp_method == "ulysses"
    )  # whole sequences by the device's kernel, as cp = 1
    if workload.compiled and workload.device == "cuda":
        kernels = compiled_kernels(shape, layout, workload, hw, hf_config)
        compute = kernels.seconds * recompute
    else:  # eager (or off CUDA): the whole step's FLOPs at one measured fraction of peak
        kernels = None
        compute = model_flops * recompute / (peak * efficiency)
        if layout.dims.cp > 1 and not ulysses:
            compute += attention_flops * recompute * (1 / attention_peak - 1 / peak) / efficiency
    # A preference objective's head recomputes its logits in backward; a live reference runs a forward first; a
    # distillation teacher runs its forward (its head's matmul in the divergence).
    objective_flops = preference_flops_per_token(hf_config, workload) + teacher_flops_per_token(workload)
    compute += objective_flops * tokens / world / (peak * efficiency)
    compute *= 1 + bubble_fraction(layout, workload)

    forwards = layout.microbatches(workload)
    local_tokens = layout.micro_batch * workload.seq_len / layout.dims.cp
    layers_per_rank = max(sum(layers for layers, _, _ in stages) for stages in stage_layout(shape, layout, workload))
    passes = 3 if layout.activation_checkpointing == "full" else 2  # forward, backward (+ recomputed forward)
    h = shape.hidden

    # Tensor parallel: per block and pass, two all-gathers and two reduce-scatters (or two all-reduces)
    # of the block's activations; nothing overlaps them.
    tp_bytes = local_tokens * h * e
    tp_one = _collective_s(
        tp_bytes, layout.dims.tp, layout.dims.tp, hw, 1.0 if layout.parallel.sequence_parallel else 2.0
    )
    tp_s = tp_one * (4 if layout.parallel.sequence_parallel else 2) * passes * layers_per_rank * forwards

    # Context parallel: every block's keys and values go round the ring forward (and their gradients
    # backward); it overlaps the attention computation of the blocks already received. Hybrid: the ring runs across
    # the cp / cp_ulysses groups (still spanning cp x tp ranks) on the K/V heads its all-to-all gathered (the group's
    # tokens of heads / cp_ulysses: cp_ulysses times a rank's K/V, KV heads repeated when fewer), and the
    # all-to-alls inside each group are on the critical path, as Ulysses'.
    ring, kv_heads = layout.dims.cp, max(shape.kv_heads // layout.dims.tp, 1)
    if layout.parallel.cp_method == "hybrid":
        ring, kv_heads = layout.dims.cp // layout.parallel.cp_ulysses, max(kv_heads, layout.parallel.cp_ulysses)
    kv_bytes = local_tokens * 2 * kv_heads * shape.head_dim * e
    cp_span = layout.dims.cp * layout.dims.tp
    cp_comm = _collective_s(kv_bytes * ring, ring, cp_span, hw) * (passes + 1) * layers_per_rank * forwards
    cp_s = max(0.0, cp_comm - attention_flops / (attention_peak * efficiency))
    if ulysses:
        cp_s = ulysses_all_to_all_s(shape, layout, workload, hw, passes, layers_per_rank, forwards)
    elif layout.dims.cp > 1 and layout.parallel.cp_method == "hybrid":
        cp_s += ulysses_all_to_all_s(
            shape, layout, workload, hw, passes, layers_per_rank, forwards, layout.parallel.cp_ulysses
        )

    # Expert parallel: the all-to-alls of the token dispatch and combine, on the critical path.
    a2a_s = expert_all_to_all_s(shape, layout, workload, hw, passes, layers_per_rank, forwards)

    # FSDP: all-gather parameters (compute dtype) for forward and backward of every microbatch,
    # reduce-scatter fp32 gradients after every microbatch (once per step where the reduction is deferred:
    # fsdp.accumulate_unsharded, pipeline stages); HSDP adds one all-reduce of the shards over dp_replicate.
    # Both run behind compute (prefetch); only what exceeds it is exposed. Under expert parallelism the
    # experts' E / ep are gathered and reduced over efsdp = dp_shard x cp / ep (whose ranks are ep x tp apart:
    # the same span), the other parameters over dp_shard x cp.
    shard = max(state_numel(shape, layout, workload))  # a rank's shard of its stages
    groups = fsdp_shard_groups(shape, layout, workload)
    fsdp_span = layout.fsdp_size * layout.dims.tp
    gathers = forwards * (2 if layout.dims.pp == 1 else 1) + forwards * workload.live_reference  # + its forward
    reduce_scatters = 1 if layout.dims.pp > 1 or workload.accumulate_unsharded else forwards
    fsdp_s = 0.0
    for numel, group in groups:
        if not numel:
            continue
        fsdp_s += gathers * _collective_s(numel * group * e, group, fsdp_span, hw)
        fsdp_s += reduce_scatters * _collective_s(numel * group * FP32, group, fsdp_span, hw)
    if workload.teacher is not None and layout.dims.fsdp_applied(workload.cpu_offload):  # its forward's all-gathers
        teacher_e = DTYPE_BYTES[workload.teacher_compute_dtype]
        for numel, group in fsdp_shard_groups(workload.teacher.shape, layout.teacher_layout(), workload):
            if numel:
                fsdp_s += forwards * _collective_s(numel * group * teacher_e, group, fsdp_span, hw)
    replicate_span = layout.dims.dp_replicate * fsdp_span
    fsdp_s += _collective_s(shard * FP32, layout.dims.dp_replicate, replicate_span, hw, 2.0)
    if workload.cpu_offload:  # shards cross PCIe: to the GPU for each gather, gradients back once reduced
        pcie = hw.pcie_gbps * 1e9 * hw.pcie_efficiency
        fsdp_s += (gathers * shard * DTYPE_BYTES[workload.model_dtype] + reduce_scatters * shard * FP32) / pcie
    fsdp_exposed = max(0.0, fsdp_s - 0.9 * compute)

    # Pipeline: each microbatch's activations cross each stage boundary forward and backward.
    pp_s = 0.0
    if layout.dims.pp > 1:
        span = world  # pp is outermost: neighbours are world / pp ranks apart
        send = _collective_s(local_tokens * h * e * 2, 2, span, hw)
        pp_s = 2 * send * forwards * layout.stages_per_rank

    offload_s = activation_offload_s(shape, layout, workload, hw, compute)

    exposed = tp_s + a2a_s + cp_s + fsdp_exposed + pp_s + offload_s + teacher_forward_comm_s(layout, workload, hw)
    optimizer_s = matrix_step_s(shape, layout, workload, hw)
    if workload.cpu_offload:  # the optimizer steps on the host, after the backward
        host_rate = hw.host_step_gbps * 1e9
        optimizer_s += max(trained_numel(shape, layout, workload)) * HOST_ADAMW_BYTES_PER_PARAM / host_rate
    seconds = compute + exposed + optimizer_s
    return StepEstimate(
        seconds=seconds,
        compute_s=compute,
        exposed_comm_s=exposed,
        tokens_per_s=tokens / seconds,
        mfu=model_flops / (seconds * hw.peak_tflops * 1e12),
        all_to_all_s=a2a_s,
        optimizer_s=optimizer_s,
        kernels=kernels,
        offload_s=offload_s,
    )


def activation_offload_s(shape: ModelShape, layout: Layout, workload: Workload, hw: Hardware, compute: float) -> float:
    """``train.activation_offload``'s copies on the critical path: each micro-batch's saved activations go to the host
    during its forwards (about a third of ``compute``) and come back during its backwards (two thirds), on a side
    stream at ``pcie_gbps x pcie_efficiency``; only what exceeds the compute they overlap is exposed."""
    one_way = offload_traffic_bytes(shape, layout, workload) / (hw.pcie_gbps * 1e9 * hw.pcie_efficiency)
    return max(0.0, one_way - compute / 3) + max(0.0, one_way - 2 * compute / 3)


def matmul_size_factor(layout: Layout, workload: Workload) -> float:
    """The fraction of the large-matmul rate a rank's matmuls reach at ``micro x seq_len / cp`` rows
    (``calibration.MATMUL_HALF_ROWS``)."""
    rows = layout.micro_batch * workload.seq_len / layout.dims.cp
    return rows / (rows + calibration.MATMUL_HALF_ROWS)


@dataclass(frozen=True)
class KernelTimes:
    """A compiled step's GPU time on one rank, by kind of kernel as a profile counts them (seconds)."""

    matmul: float
    attention: float
    elementwise: float
    """The blocks' fused elementwise kernels, the loss's, and float8's casts."""
    parameters: float
    """Passes over the parameters: the per-micro-batch gradient casts and adds, the weight casts, AdamW."""
    host: float
    """Time the GPU waits on the host (tensor parallelism's dispatch), beyond the kernels' idle share."""

    @property
    def seconds(self) -> float:
        return (self.matmul + self.attention + self.elementwise + self.parameters) / calibration.GPU_BUSY + self.host


def compiled_kernels(shape: ModelShape, layout: Layout, workload: Workload, hw: Hardware, hf_config) -> KernelTimes:
    """A compiled step's kernels on the busiest rank, without communication (meshtron.plan.calibration says which
    measured run each constant comes from). Matmuls: the blocks' and the head's FLOPs at
    ``compiled_matmul_efficiency x matmul_size_factor`` of the compute dtype's peak (the blocks' at the float8 peak
    under ``precision.float8``). Attention: causal attention FLOPs at ``ATTENTION_EFFICIENCY``, less on short spans.
    The rest is bound by memory bandwidth (``hbm_gbps x hbm_efficiency``): elementwise work in proportion to what
    blocks keep for backward, the loss's passes over its logits, and passes over every trained parameter."""
    from meshtron.plan.memory import (
        block_activation_per_token,
        casts_weights,
        fused_loss,
        fused_loss_vocab,
        loss_vocab,
    )

    world, e = layout.dims.world_size, compute_bytes(workload)
    rank_tokens = workload.global_batch * workload.seq_len / world  # FLOPs of a rank: its share of the step's
    local_tokens = layout.local_batch(workload) * workload.seq_len / layout.dims.cp  # tokens a rank's blocks see
    peak = (hw.peak_tflops if e == 2 else hw.fp32_tflops) * 1e12
    rate = peak * hw.compiled_matmul_efficiency * matmul_size_factor(layout, workload)
    head_flops = 6 * shape.hidden * shape.vocab * rank_tokens
    matmul_flops = (flops_per_token(hf_config, 0) + shape.lora_flops_per_token) * rank_tokens
    block_flops = matmul_flops - head_flops
    float8_rate = (
        hw.fp8_tflops * 1e12 * calibration.FLOAT8_MATMUL_RATE[workload.float8_recipe] * hw.compiled_matmul_efficiency
    ) * matmul_size_factor(layout, workload)
    block_rate = float8_rate if workload.float8 and float8_rate > rate else rate
    matmul = block_flops / block_rate + head_flops / rate

    span = workload.seq_len
    attention_flops = (flops_per_token(hf_config, span) - flops_per_token(hf_config, 0)) * rank_tokens
    # (under cp the fused tile kernels cover the same span in pieces: costed as without cp)
    attention_rate = peak * calibration.ATTENTION_EFFICIENCY * span / (span + calibration.ATTENTION_HALF_SPAN)

    bandwidth = hw.hbm_gbps * 1e9 * hw.hbm_efficiency
    layers = max(sum(n for n, _, _ in stages) for stages in stage_layout(shape, layout, workload))
    unconverted = dataclasses.replace(workload, float8=False)  # float8 changes what is kept, not what is computed
    kept = block_activation_per_token(shape, layout, unconverted) * layers * local_tokens
    elementwise = calibration.ELEMENTWISE_PASSES * kept
    holds_head = layout.dims.pp == 1  # the busiest pipeline rank is costed as if it held the head too
    if holds_head and fused_loss(workload):
        elementwise += local_tokens * fused_loss_vocab(shape, layout) * (3 * e + calibration.FUSED_LOSS_BYTES_PER_LOGIT)
    elif holds_head:
        elementwise += local_tokens * loss_vocab(shape, layout) * (3 * e + calibration.UNFUSED_LOSS_BYTES_PER_LOGIT)
    if workload.float8:
        elementwise += calibration.FLOAT8_CAST_BYTES_PER_ELEMENT * local_tokens * layers * _linear_width(shape, layout)
    trained = max(trained_numel(shape, layout, workload))
    per_step = calibration.ADAMW_BYTES_PER_PARAM if optimizer_entry(workload.optimizer).adamw_pass else 0
    if casts_weights(layout, workload):
        per_step += calibration.WEIGHT_CAST_BYTES_PER_PARAM
    later_microbatches = layout.microbatches(workload) - 1
    passes = (
        calibration.GRADIENT_CAST_BYTES_PER_PARAM
        + later_microbatches * calibration.GRADIENT_ACCUMULATE_BYTES_PER_PARAM
        + per_step
    )
    host = 0.0
    if layout.dims.tp > 1:
        host = calibration.TP_HOST_S_PER_BLOCK_PASS * 2 * layers * layout.microbatches(workload)
    return KernelTimes(
        matmul=matmul,
        attention=attention_flops / attention_rate,
        elementwise=elementwise / bandwidth,
        parameters=trained * passes / bandwidth,
        host=host,
    )


def _linear_width(shape: ModelShape, layout: Layout) -> int:
    """Elements per token a block's float8 casts scan: every linear's input in forward (q/k/v's and gate/up's
    inputs, o_proj's and down's) and every linear's output gradient in backward, on one tp rank."""
    tp = layout.dims.tp
    q, kv = shape.heads // tp * shape.head_dim, max(shape.kv_heads // tp, 1) * shape.head_dim
    inputs = 2 * shape.hidden + q + shape.intermediate // tp
    output_gradients = q + 2 * kv + 2 * shape.hidden + 2 * shape.intermediate // tp
    return inputs + output_gradients


def matrix_step_s(shape: ModelShape, layout: Layout, workload: Workload, hw: Hardware) -> float:
    """The optimizer's step on whole block matrices on the busiest rank (its registry entry's ``matrix_step_flops``:
    Muon's, meshtron.train.optim.muon): every block matrix a rank holds a shard of is all-gathered whole over its
    FSDP x TP ranks (model dtype) and stepped there, by every one of them (Muon: ``ns_steps`` Newton-Schulz iterations
    of ``4 m^2 n + 2 m^3`` FLOPs for an (m, n) matrix, m <= n), at the compute dtype's matmul rate; expert matrices
    are whole on their rank (only its own experts). 0 under an optimizer without such a step (AdamW)."""
    entry = optimizer_entry(workload.optimizer)
    if entry.matrix_step_flops is None:
        return 0.0
    settings = workload.optimizer_settings or entry.settings()
    rate = (hw.peak_tflops if compute_bytes(workload) == 2 else hw.fp32_tflops) * 1e12 * hw.matmul_efficiency
    group = layout.fsdp_size * layout.dims.tp
    one_block = 0.0
    for spec in shape.block:
        if not spec.muon:
            continue
        rows, cols = spec.shape[-2:]
        matrix_flops = entry.matrix_step_flops(settings, rows, cols)
        if spec.expert:
            local = spec.local_numel(layout.dims.tp, layout.fsdp_size, shape.kv_heads, layout.dims.ep)
            one_block += local // (rows * cols) * matrix_flops / rate
            continue
        one_block += matrix_flops / rate
        if group > 1:
            one_block += _collective_s(rows * cols * DTYPE_BYTES[workload.model_dtype], group, group, hw)
    layers = max(sum(layers for layers, _, _ in stages) for stages in stage_layout(shape, layout, workload))
    return layers * one_block


def expert_shard_numel(shape: ModelShape, layout: Layout, workload: Workload) -> int:
    """Expert-parameter elements in the busiest pipeline rank's FSDP shard (its share of ``state_numel``)."""
    experts = sum(
        p.local_numel(layout.dims.tp, layout.fsdp_size, shape.kv_heads, layout.dims.ep) for p in shape.block if p.expert
    )
    return experts * max(sum(layers for layers, _, _ in stages) for stages in stage_layout(shape, layout, workload))
