"""How far a run is from its one-process reference, and whether that is rounding or a defect.

The bounds follow tests/test_parity.py (fp32, a few AdamW steps): layouts that split matmuls (TP) or sums (FSDP,
CP, gradient accumulation) round differently from one process by ~1e-7 per operation; over a few Adam steps that
grows to a few 1e-6 relative in the weights, and an element whose gradient is ~0 can move by a few 1e-5 because
Adam divides by sqrt(v). A defect (a wrong shard, a missing or doubled reduction, a wrong loss scale, a collective
that returns wrong data) moves losses and whole tensors by orders of magnitude more; Adam hides a uniform gradient
scale in the weights, the gradient norm does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    loss: float
    """Relative difference of any step's loss."""
    grad_norm: float
    """Relative difference of any step's gradient norm."""
    weight_rel_l2: float
    """Relative L2 difference of any final weight tensor."""
    weight_max_abs: float
    """Largest difference of any final weight element."""


CPU = Tolerance(loss=2e-5, grad_norm=2e-4, weight_rel_l2=5e-5, weight_max_abs=2e-4)
"""gloo on CPU: twice the parity suite's bounds (which hold there at 4 steps, worst 1.3e-5 / 1.6e-5 in weights)."""
CUDA = Tolerance(loss=1e-4, grad_norm=1e-3, weight_rel_l2=3e-4, weight_max_abs=3e-3)
"""NCCL on GPUs, fp32 with TF32 off: cuBLAS picks kernels by shape (a TP shard is another shape), attention kernels
and NCCL's reductions sum in other orders, and a GPU against the CPU differs in every kernel. Still 30x under one
lr-sized step (1e-3) per element over the steps in relative L2, and a defect is >= 1e-2. Measured on one H100
(torch 2.11, 2026-11-26): the GPU's one-process run against the CPU's, loss 8.5e-8, gradient norm 1.7e-7, weights
7.9e-7 relative L2, 1.5e-6 max abs. Not yet measured on a multi-GPU machine (NCCL's reduction orders): widen with
the measured worst case (the table prints it) if a healthy cluster fails."""


@dataclass
class Comparison:
    loss: float = 0.0
    grad_norm: float = 0.0
    weight_rel_l2: float = 0.0
    weight_max_abs: float = 0.0
    problems: list[str] | None = None

    @property
    def passed(self) -> bool:
        return not self.problems


def _relative(value: float, ref: float) -> float:
    if math.isnan(value) or math.isnan(ref):
        return math.inf
    return abs(value - ref) / max(abs(ref), 1e-12)


def compare(ranks: list[dict], reference: dict, tol: Tolerance) -> Comparison:
    """``ranks``: each rank's ``{losses, grad_norms, state}`` (meshtron.check.worker); ``reference``: the
    one-process run's. Every rank's losses, gradient norms and view of the weights count; the worst is reported."""
    import torch

    out = Comparison(problems=[])
    steps = len(reference["losses"])
    for rank, got in enumerate(ranks):
        if len(got["losses"]) != steps:
            out.problems.append(f"rank {rank} trained {len(got['losses'])} steps, one process {steps}")
            continue
        out.loss = max([out.loss] + [_relative(a, b) for a, b in zip(got["losses"], reference["losses"])])
        out.grad_norm = max(
            [out.grad_norm] + [_relative(a, b) for a, b in zip(got["grad_norms"], reference["grad_norms"])]
        )
    if out.loss > tol.loss:
        out.problems.append("losses")
    if out.grad_norm > tol.grad_norm:
        out.problems.append("gradient norms")
    want = reference["state"]
    seen: set[str] = set()
    for rank, got in enumerate(ranks):
        unknown = sorted(set(got["state"]) - set(want))
        if unknown:
            out.problems.append(f"rank {rank} has weights one process lacks: {', '.join(unknown[:3])}")
        for name, tensor in got["state"].items():
            if name not in want:
                continue
            seen.add(name)
            ref = want[name].float()
            diff = tensor.float() - ref
            if diff.shape != ref.shape:
                out.problems.append(f"{name}: shape {tuple(tensor.shape)} vs {tuple(ref.shape)}")
                continue
            norm = ref.norm().item()
            rel = diff.norm().item() / norm if norm > 0 else diff.norm().item()
            largest = diff.abs().max().item() if diff.numel() else 0.0
            rel, largest = (math.inf, math.inf) if not torch.isfinite(tensor).all() else (rel, largest)
            out.weight_rel_l2, out.weight_max_abs = max(out.weight_rel_l2, rel), max(out.weight_max_abs, largest)
    missing = sorted(set(want) - seen)
    if missing:
        out.problems.append(f"no rank holds {', '.join(missing[:3])}")
    if out.weight_rel_l2 > tol.weight_rel_l2 or out.weight_max_abs > tol.weight_max_abs:
        out.problems.append("weights")
    return out
