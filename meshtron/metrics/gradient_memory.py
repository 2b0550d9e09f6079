"""Gradient bytes a rank holds between the micro-batches of a gradient accumulation.

Under FSDP2 the gradients in flight are not all in ``param.grad``: a block whose reduce-scatter was
deferred keeps its full-size gradient on the unsharded parameter (or, cast to the reduce dtype, in
``unsharded_accumulated_grad``), and HSDP keeps reduce-scattered shards awaiting the replica
all-reduce in its parameter group's partial output. This module reads those FSDP2 internals (present
in torch 2.11 to 2.13) to measure what the planner charges as held gradients.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from meshtron.metrics.memory import local_bytes


def _fsdp_param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: at most one group per module
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _fsdp_held_bytes(module: FSDPModule) -> int:
    """Deferred (unsharded) gradients and HSDP partial reductions of one FSDP module's own parameters."""
    held = 0
    for group in _fsdp_param_groups(module):
        held += local_bytes(getattr(group, "_partial_reduce_output", None))
        for fsdp_param in group.fsdp_params:
            accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if accumulated is not None:
                held += local_bytes(accumulated)
            elif hasattr(fsdp_param, "_unsharded_param"):
                held += local_bytes(fsdp_param._unsharded_param.grad)
    return held


def held_gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradients this rank holds now: ``param.grad`` (local shards) plus FSDP2's deferred and
    partially reduced gradients."""
    held = sum(local_bytes(p.grad) for p in model.parameters())
    return held + sum(_fsdp_held_bytes(m) for m in model.modules() if isinstance(m, FSDPModule))
