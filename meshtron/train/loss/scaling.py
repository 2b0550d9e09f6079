"""fp16's dynamic loss scaling (``LossScaler``): the loss is multiplied by the scale before backward; a step
whose global gradient norm is not finite is skipped and the scale halved. The norm is the global one (one
all-reduce over every shard), so this is sharded loss scaling. The precision policy and the compute casts
are in ``meshtron.distributed.precision``.
"""

from __future__ import annotations

import torch

from meshtron.config import Config
from meshtron.distributed.precision import PrecisionPolicy
from meshtron.tensors import local_tensor


class LossScaler:
    """fp16's dynamic loss scale: halve on overflow, double after ``growth_interval`` clean steps."""

    def __init__(self, initial: float, growth_interval: int):
        self.scale, self.growth_interval, self.clean_steps = float(initial), growth_interval, 0

    def update(self, overflowed: bool) -> None:
        if overflowed:
            self.scale, self.clean_steps = self.scale / 2, 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale, self.clean_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def loss_scaler(policy: PrecisionPolicy, cfg: Config) -> LossScaler | None:
    if not policy.loss_scaling:
        return None
    return LossScaler(cfg.precision.fp16_initial_loss_scale, cfg.precision.fp16_growth_interval)


@torch.no_grad()
def unscale_gradients(parameters, loss_scale: float) -> None:
    """Divide every gradient by the loss scale it was computed with (fp16 loss scaling)."""

    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / loss_scale)
