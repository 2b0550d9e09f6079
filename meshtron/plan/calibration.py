"""The planner's measured constants: what a compiled training step's kernels cost on a GPU, and where each
figure comes from.

Sources: ``tests/fixtures/h100-2026-11-26.json`` (a copy of ``shared/gpu-measurements/h100-2026-11-26.json``:
one H100 80GB HBM3, torch 2.11, 2026-11-26; meshtron with fp32 master weights, bf16 compute, compiled blocks,
document masks) and the kernel trace of its llama-1b batch-8 run (seq 2048, one micro-batch of 8), whose
264 ms of kernels a step split into cuBLAS matmuls 156.8 ms, FlexAttention 35.9 ms, fused AdamW 18.8 ms,
copies and casts 9.4 ms, and fused elementwise work 43.4 ms (of which fp32 gradient adds 5.6 ms).

*Fitted* constants were solved from those runs; the others are derived from first principles. Which run
fitted what (tests/test_plan_calibration.py holds the planner to every run, the fitted ones and the predicted
ones alike):

* llama-1b b8 (the trace): ``Hardware.compiled_matmul_efficiency``, ``Hardware.hbm_efficiency``,
  ``ELEMENTWISE_PASSES``, ``ATTENTION_EFFICIENCY``, ``GPU_BUSY``;
* llama-1b seq 8192 b2 (its step time, with the trace's attention at seq 2048): ``ATTENTION_HALF_SPAN``;
* llama-8b tp=8 rehearsal (its compute-only step): ``TP_HOST_S_PER_BLOCK_PASS``;
* the H100 and H200 traces' gradient cast: ``GRADIENT_CAST_BYTES_PER_PARAM``;
* llama-1b b8 rowwise float8 on the H200: ``FLOAT8_MATMUL_RATE``'s rowwise share.

``tests/fixtures/h200-2026-11-28.json`` (one H200, the same software, 2026-11-28, ``bench/one_gpu_checks/issue61.sh``:
llama-1b b8 with flex and varlen attention, float8 tensorwise and rowwise, seq 8192 b2, eager) and its b8 trace
(cuBLAS 157.2 ms a step, FlexAttention 35.5, AdamW 14.2, copies 7.6, other 31.5 of 246.1 ms; GPU busy 94%) were
met by the H100's constants within 11% (step) and 5% (memory) except rowwise float8 (-23%, then fitted).

Predicted, not fitted: llama-1b b16, ``train.loss_chunk_size=0``, ``precision.float8=true`` and every activation
and peak-memory figure (the memory model is derived from what the compiled block keeps, not fitted).
"""

from __future__ import annotations

GPU_BUSY = 0.973
"""Share of a step's wall time the GPU runs kernels: 264 ms of kernels in a 271.5 ms step (llama-1b b8 trace)."""

MATMUL_HALF_ROWS = 512
"""Rows (tokens of one forward on a rank) at which a matmul reaches half of ``compiled_matmul_efficiency``:
``efficiency x rows / (rows + MATMUL_HALF_ROWS)``. Derived, not fitted: a cuBLAS tile is 128 x 256, and each
kernel pays a fixed prologue / epilogue and a last partial wave of tiles over the GPU's SMs whatever its size,
about the time of ``MATMUL_HALF_ROWS`` rows of work at a hidden size of a few thousand; llama-1b at micro-batch
8 (16,384 rows) runs at 97% of the large-matmul rate, at micro-batch 1 (2,048) at 80%. No recorded run has
small enough matmuls to fit it: re-measure with a micro-batch 1 run."""

ATTENTION_EFFICIENCY = 0.37
"""Fraction of the compute dtype's peak FlexAttention reaches on long spans, on causal attention FLOPs
(``meshtron.metrics.flops``), with document masks on (they skip blocks, so this is an effective figure for the
benchmark's documents). Fitted with ``ATTENTION_HALF_SPAN`` so that the llama-1b b8 trace's attention (35.9 ms
at seq 2048) and the seq 8192 b2 run's step time are met."""

ATTENTION_HALF_SPAN = 2048
"""Sequence length at which attention reaches half of ``ATTENTION_EFFICIENCY``: a per-query cost that does not
grow with the span (loading q, the diagonal blocks, the backward's row sums), ``S / (S + ATTENTION_HALF_SPAN)``.
Fitted on the seq 8192 b2 run (its 56.6 ms more per step than seq 2048 at the same tokens)."""

ELEMENTWISE_PASSES = 2.15
"""Bytes the compiled blocks' fused elementwise kernels (norms, rope, SiLU, residual adds, in forward and
backward) move, in multiples of the bytes a block keeps for backward (in the compute dtype, without float8).
Fitted on the llama-1b b8 trace: its 43.4 ms of elementwise kernels less the fp32 gradient adds (5.6 ms) and the
fused loss (``FUSED_LOSS_BYTES_PER_LOGIT``)."""

FUSED_LOSS_BYTES_PER_LOGIT = 8
"""Bytes the fused head + cross-entropy moves per logit beyond the compute dtype's three passes (logits
written, read; gradient written): its fp32 exponentials, written and read once (meshtron.train.loss.fused)."""

UNFUSED_LOSS_BYTES_PER_LOGIT = 24
"""The same without the fused loss (``train.loss_chunk_size=0``): the fp32 copy of the logits, the fp32
log-softmax (written, read in backward), the fp32 gradient (written, read by its cast), beyond the compute
dtype's three passes."""

GRADIENT_CAST_BYTES_PER_PARAM = 8
"""Bytes per trained parameter, at the planner's bandwidth, of the first micro-batch's gradient: the compute-dtype
gradient written to the fp32 master's ``.grad`` (moves 6: read 2, write 4; meshtron.distributed.precision
``_ComputeCast``). Fitted on both traces, whose cast kernel (torch's unrolled elementwise copy, which does not
speed up with the HBM) took 4.49 ms on the H100 (6.9 bytes at its planner bandwidth) and 4.12 ms on the H200
(9.1). Since 2026-11-28 the big gradients' cast is ``torch._foreach_copy_``'s kernel (``precision.widened``),
whose speed is not yet measured: re-fit from the next trace."""

GRADIENT_ACCUMULATE_BYTES_PER_PARAM = 13
"""Each later micro-batch's gradient added into the fp32 ``.grad`` in one mixed-dtype kernel (moves 10: read 4 + 2,
write 4), with the cast's slowdown (8 / 6): derived, not measured (no traced run had several micro-batches)."""

WEIGHT_CAST_BYTES_PER_PARAM = 6
"""The once-per-step compute-dtype copies of fp32 master weights (read 4, write 2)."""

ADAMW_BYTES_PER_PARAM = 28
"""Fused AdamW: reads the fp32 parameter, gradient and both moments (16), writes the parameter and moments
(12). The trace's 18.8 ms for llama-1b's 1.24 B parameters sets, with the casts and adds above,
``Hardware.hbm_efficiency``."""

FLOAT8_CAST_BYTES_PER_ELEMENT = 5
"""``precision.float8`` (torchao, tensorwise): each float8 matmul operand is scanned for its max (read 2) and
cast (read 2, write 1): every block linear's input in forward and its output gradient in backward."""

FLOAT8_MATMUL_RATE = {"tensorwise": 1.0, "rowwise": 0.5, "rowwise_with_gw_hp": 0.5}
"""Share of the GPU's float8 peak each ``precision.float8_recipe``'s block matmuls reach, relative to
``compiled_matmul_efficiency``; the block matmuls never plan slower than in the compute dtype. Tensorwise: one
scale per tensor, cuBLAS's float8 GEMM at full rate (predicted, then met within 11% on the H100 and H200 runs).
Rowwise (a scale per row, torch's ``_scaled_mm`` with row scales, torchao 0.18) ran no faster than bf16 on one H200
(llama-1b b8: 0.265 s a step vs 0.261 in bf16 and 0.230 tensorwise, 2026-11-28): at half the float8 peak, i.e.
the bf16 rate, the planner meets it; ``rowwise_with_gw_hp`` (weight gradients in bf16) is costed the same, not
measured."""

TP_HOST_S_PER_BLOCK_PASS = 0.88e-3
"""Time a tensor-parallel block adds per pass (forward or backward) on top of its kernels: DTensor's dispatch
and redistribution on the host and the collectives' launches, which keep the GPU waiting. Fitted on the
llama-8b tp=8 seq 8192 rehearsal (0.181 s without communication, 0.125 s of it kernels by this model, 64 block passes);
not yet separated by a trace: re-measure with ``run.profile_steps`` on a tp rehearsal."""
