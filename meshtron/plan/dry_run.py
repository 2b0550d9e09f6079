"""``meshtron train --dry-run``: build one rank's real sharded model without the hardware and report its bytes.

The rank joins a fake process group of the full world size (PyTorch's ``fake`` backend: collectives
return at once), builds the model on the meta device, applies meshtron's real ``parallelize`` (PP
split, TP, CP, FSDP), creates the optimizer and takes one AdamW step on meta gradients, so that the
parameter, gradient and optimizer-state shards it reports are the ones a real run of that rank holds.
No weights are allocated: a 70B model at 512 ranks dry-runs on a laptop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import Config
from meshtron.errors import ConfigError


@dataclass(frozen=True)
class DryRunReport:
    rank: int
    world_size: int
    layout: str
    stages: tuple[int, ...]
    params: int
    grads: int
    optimizer: int
    seconds: float
    pinned_state: int | None = None
    """Under ``fsdp.cpu_offload``: the pinned host memory of the parameter and gradient shards (pinned_state_bytes)."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


def dry_run(cfg: Config, world_size: int, rank: int = 0) -> DryRunReport:
    """Shard the model of ``cfg`` as rank ``rank`` of ``world_size`` would, on the meta device."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtron.distributed.parallelize import parallelize
    from meshtron.metrics.memory import model_state_bytes, pinned_state_bytes
    from meshtron.models.build import build_meta_model
    from meshtron.train.optim.build import build_optimizer
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.setup.run_setup import parallelize_options

    if not 0 <= rank < world_size:
        raise ConfigError(f"--dry-run-rank {rank} is not a rank of a world of {world_size}; use 0..{world_size - 1}")
    if dist.is_initialized():
        raise ConfigError("--dry-run cannot run inside a distributed job; run it as a plain process")
    started = time.perf_counter()
    setup = preflight(cfg, world_size, "cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        meshes = setup.dims.build_mesh("cpu")
        model, adapter = build_meta_model(setup.hf_config, cfg.model)
        stages = parallelize(model, adapter, setup.dims, meshes, parallelize_options(cfg, setup))
        parts = nn.ModuleList([module for _, module in stages])
        optimizer = build_optimizer(parts, cfg.optimizer, list(parts), adapter)
        for group in optimizer.param_groups:
            # Same state, but per-tensor updates: DTensor's first sharding propagation of a foreach op
            # over hundreds of differently placed tensors takes minutes on a 3-D mesh; per-tensor ops hit its cache.
            group["foreach"] = False
        for param in parts.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()  # creates AdamW's moments, sharded like their parameters (on the meta device)
        measured = model_state_bytes(parts, optimizer)
        pinned = pinned_state_bytes(parts) if cfg.fsdp.cpu_offload else None
    finally:
        dist.destroy_process_group()
    return DryRunReport(
        rank=rank,
        world_size=world_size,
        layout=setup.dims.describe(),
        stages=tuple(s for s, _ in stages),
        params=measured["params"],
        grads=measured["grads"],
        optimizer=measured["optimizer"],
        seconds=time.perf_counter() - started,
        pinned_state=pinned,
    )
