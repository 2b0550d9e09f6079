"""``meshtron plan --max-seq-len``: the longest sequence a model trains at on a cluster, and the settings it needs.

A length fits when some layout the planner enumerates (tensor, context and pipeline degrees, activation
checkpointing) fits the GPUs' and the host's memory with some of the long-context savings: activation offloading,
tiled MLPs and the model state in host memory (``fsdp.cpu_offload``; docs/long-context.md). Memory grows with the
length, so the longest is found by doubling, then bisecting, in steps of ``granularity`` tokens; it never passes the
model's ``max_position_embeddings`` (extend it with ``--rope-scaling`` / ``--max-position-embeddings``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.plan.hardware import Hardware
from meshtron.plan.layout import Workload
from meshtron.plan.model_shape import ModelShape
from meshtron.plan.search import Candidate, plan_layouts

GRANULARITY = 1024
"""Lengths are searched in multiples of this many tokens."""
LONGEST_SEARCHED = 1 << 27
"""The search stops here (134M tokens) when the model's positions do not stop it before."""
DEFAULT_MLP_TILES = 8
"""``train.mlp_tiles`` tried when ``--mlp-tiles`` does not say."""


@dataclass(frozen=True)
class Longest:
    """The longest length that fits (0: not even ``granularity``), the fastest way to train at it, and what stopped
    the search there."""

    seq_len: int
    candidate: Candidate | None
    workload: Workload | None
    bound: str
    """``memory``: one more step of ``granularity`` tokens fits no layout; ``positions``: the model's
    ``max_position_embeddings``; ``search``: LONGEST_SEARCHED."""


def savings_variants(shape: ModelShape, base: Workload) -> list[Workload]:
    """``base`` with activation offloading off and on, tiled MLPs off and on (dense MLPs only), and the model state
    on the GPU or in host memory (``fsdp.cpu_offload``); what ``base`` turns on stays on."""
    tiles = [0] if shape.experts else sorted({0, base.mlp_tiles or DEFAULT_MLP_TILES})
    offloads = [True] if base.activation_offload else [False, True]
    host_state = [True] if base.cpu_offload else [False, True]
    return [
        dataclasses.replace(base, mlp_tiles=t, activation_offload=o, cpu_offload=c)
        for c in host_state
        for o in offloads
        for t in tiles
    ]


def fastest_fit(shape: ModelShape, hf_config, base: Workload, seq_len: int, gpus: int, hw: Hardware):
    """(candidate, workload) of the fastest layout and savings that fit ``seq_len`` tokens, or None."""
    best = None
    for workload in savings_variants(shape, dataclasses.replace(base, seq_len=seq_len)):
        fitting = [c for c in plan_layouts(shape, hf_config, workload, gpus, hw) if c.fits]
        if fitting and (best is None or fitting[0].step.tokens_per_s > best[0].step.tokens_per_s):
            best = (fitting[0], workload)
    return best


def longest_sequence(
    shape: ModelShape, hf_config, base: Workload, gpus: int, hw: Hardware, granularity: int = GRANULARITY
) -> Longest:
    """The longest multiple of ``granularity`` that ``base`` (its sequence length aside) trains at on ``gpus``."""
    positions = getattr(hf_config, "max_position_embeddings", None) or LONGEST_SEARCHED
    cap = min(positions, LONGEST_SEARCHED) // granularity * granularity
    fits = {}

    def fit(length: int):
        if length not in fits:
            fits[length] = fastest_fit(shape, hf_config, base, length, gpus, hw)
        return fits[length]

    if cap < granularity or fit(granularity) is None:
        return Longest(0, None, None, "memory")
    low, high = granularity, None  # low fits; high (when known) does not
    while high is None:
        nxt = min(low * 2, cap)
        if nxt == low:
            break
        if fit(nxt) is None:
            high = nxt
        else:
            low = nxt
    while high is not None and high - low > granularity:
        middle = (low + high) // 2 // granularity * granularity
        if fit(middle) is None:
            high = middle
        else:
            low = middle
    if high is not None:
        bound = "memory"
    else:
        bound = "positions" if cap == positions // granularity * granularity else "search"
    candidate, workload = fit(low)
    return Longest(low, candidate, workload, bound)
