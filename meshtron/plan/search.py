"""Enumerate the layouts meshtron can run a workload with on a cluster, estimate each, rank the ones that fit."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from meshtron.config import ParallelOptions
from meshtron.distributed.mesh import ParallelDims
from meshtron.errors import ConfigError
from meshtron.plan.hardware import Hardware
from meshtron.plan.layout import Layout, Workload
from meshtron.plan.memory import MemoryEstimate, estimate_memory
from meshtron.plan.model_shape import ModelShape
from meshtron.plan.throughput import StepEstimate, estimate_step

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    values, v = [], 1
    while v <= limit:
        values.append(v)
        v *= 2
    return values


def _valid(hf_config, layout: Layout, workload: Workload) -> bool:
    """Whether ``meshtron train``'s preflight accepts ``layout`` (``Layout.check``: the same checks)."""
    try:
        layout.check(hf_config, workload)
    except ConfigError:
        return False
    return True


def expert_degrees(shape: ModelShape, dp_shard: int, cp: int) -> list[int]:
    """The ``parallel.ep`` values worth trying: 1, and for a mixture of experts every divisor of both its
    expert count and ``dp_shard x cp`` (meshtron's rules; ``Layout.check`` applies them again)."""
    if not shape.experts:
        return [1]
    return _divisors(math.gcd(shape.experts, dp_shard * cp))


def cp_methods(cp: int, tp: int, hw: Hardware) -> list[tuple[str, int]]:
    """``(parallel.cp_method, parallel.cp_ulysses)`` worth trying at this cp: ring and Ulysses, and where the cp ranks
    span several nodes, hybrid with the cp ranks of one node as its Ulysses groups (the ring across nodes)."""
    if cp == 1:
        return [("ring", 0)]
    in_node = hw.gpus_per_node // tp  # cp ranks are tp apart: a node holds this many consecutive ones
    hybrid = [("hybrid", in_node)] if 1 < in_node < cp and cp % in_node == 0 else []
    return [("ring", 0), ("ulysses", 0), *hybrid]


def candidate_layouts(
    shape: ModelShape, hf_config, workload: Workload, gpus: int, hw: Hardware, max_micro_batch: int = 16
) -> list[Layout]:
    """Every layout worth estimating: tp within a node, cp and pp as powers of two (cp by ring, by Ulysses where
    the heads allow it and by hybrid where cp spans nodes: ``cp_methods``), dp split as FSDP across all data-parallel
    ranks or as HSDP (FSDP inside a node, replicas across nodes), and for a mixture of experts every expert-parallel
    degree meshtron allows."""
    layouts = []
    for tp in [t for t in _powers_of_two(hw.gpus_per_node) if gpus % t == 0]:
        for cp in [c for c in _powers_of_two(16) if gpus % (tp * c) == 0]:
            for pp in [p for p in _powers_of_two(64) if gpus % (tp * cp * p) == 0 and p <= shape.layers // 2 or p == 1]:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if workload.global_batch % dp:
                    continue
                local = workload.global_batch // dp
                shard_in_node = max(1, hw.gpus_per_node // (tp * cp))
                splits = {(1, dp)}
                if dp > shard_in_node and dp % shard_in_node == 0:
                    splits.add((dp // shard_in_node, shard_in_node))
                schedules = [("1F1B", 1), ("Interleaved1F1B", 2)] if pp > 1 else [("1F1B", 1)]
                for dp_replicate, dp_shard in sorted(splits):
                    for micro in [m for m in _powers_of_two(min(local, max_micro_batch)) if local % m == 0]:
                        if pp > 1 and local // micro < pp:
                            continue
                        for schedule, per_rank in schedules:
                            if schedule == "Interleaved1F1B" and shape.layers < 2 * pp:
                                continue
                            for ac, ep, (method, ulysses) in itertools.product(
                                AC_MODES, expert_degrees(shape, dp_shard, cp), cp_methods(cp, tp, hw)
                            ):
                                layout = Layout(
                                    ParallelDims(dp_replicate, dp_shard, cp, tp, pp, ep),
                                    micro,
                                    ac,
                                    ParallelOptions(
                                        cp_method=method,
                                        cp_ulysses=ulysses,
                                        pp_schedule=schedule,
                                        pp_stages_per_rank=per_rank if per_rank > 1 else None,
                                    ),
                                )
                                if _valid(hf_config, layout, workload):
                                    layouts.append(layout)
    return layouts


def check_cluster(gpus: int, hw: Hardware) -> None:
    """Refuse a cluster that is not a whole number of nodes."""
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}")
    if gpus > hw.gpus_per_node and gpus % hw.gpus_per_node:
        raise ConfigError(
            f"--gpus {gpus} is not a whole number of nodes of {hw.gpus_per_node}; fix --gpus or --gpus-per-node"
        )


def complexity(layout: Layout) -> int:
    """How many mechanisms a layout adds to plain FSDP: the tie-breaker between equally fast layouts."""
    return (
        sum(d > 1 for d in (layout.dims.pp, layout.dims.dp_replicate, layout.dims.cp, layout.dims.tp, layout.dims.ep))
        + (layout.activation_checkpointing != "none")
        + (layout.stages_per_rank > 1)
    )


def _speed_band(tokens_per_s: float) -> int:
    """Layouts within about 2% of each other's predicted speed are treated as equally fast."""
    return -int(math.log(tokens_per_s) / math.log(1.02))


def plan_layouts(shape: ModelShape, hf_config, workload: Workload, gpus: int, hw: Hardware) -> list[Candidate]:
    """All candidates: those that fit first; fastest first, within 2% the simplest, then the smallest."""
    check_cluster(gpus, hw)
    # What the model refuses whatever the split, on one GPU (e.g. Gemma 2's soft-capping with document masks).
    Layout().check(hf_config, workload)
    usable = hw.memory_bytes - hw.reserved_gb * 1e9
    results = []
    for layout in candidate_layouts(shape, hf_config, workload, gpus, hw):
        memory = estimate_memory(shape, layout, workload)
        step = estimate_step(shape, layout, workload, hw, hf_config)
        fits = memory.total <= usable and memory.host <= hw.host_memory_gb * 1e9
        results.append(Candidate(layout, memory, step, fits))
    results.sort(key=lambda c: (not c.fits, _speed_band(c.step.tokens_per_s), complexity(c.layout), c.memory.total))
    return results
