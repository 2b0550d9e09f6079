"""Muon for the decoder blocks' matrices, AdamW for everything else (``train.optimizer=muon``).

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is scalable for LLM training") keeps one momentum buffer per matrix
and steps along its orthogonalized direction: five Newton-Schulz iterations turn the (Nesterov) momentum ``M`` into
roughly ``U V^T`` of its singular value decomposition. The step is scaled by ``0.2 * sqrt(max(rows, cols))`` so that
its RMS matches AdamW's, as Moonshot's recipe does, so one ``train.lr`` serves both, and weight decay is decoupled
(``p *= 1 - lr * weight_decay``). Muon takes the 2-D weights of the decoder blocks and, per expert, the 3-D expert
weights of MoE blocks; AdamW takes the embeddings, the head, norms, biases and the MoE routers, as the Muon papers do.

The orthogonalization needs whole matrices. A parameter sharded by FSDP (rows) or tensor parallelism (rows or
columns) has its update gathered whole on every rank (``full_tensor``), orthogonalized there, and each rank keeps its
own shard of the result, so every layout computes the one-process update. Expert weights sharded only along the
expert dimension (expert parallelism, FSDP over experts) hold whole matrices and are orthogonalized where they are.
The momentum buffers are sharded like their parameters: checkpoints save and reshard them as they do AdamW's moments.
Newton-Schulz runs in bf16 under bf16 mixed precision, in float32 otherwise. See docs/optimizers.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# Keller Jordan's quintic coefficients: fast convergence of the singular values towards ~1 (not exactly 1).
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2
"""The update of an (A, B) matrix is scaled by RMS_MATCH * sqrt(max(A, B)): an RMS near AdamW's (Moonshot)."""


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32, eps: float = 1e-7):
    """Approximately orthogonalize the last two dims of ``matrix`` (batched over the others), computing in ``dtype``
    (bf16 under bf16 mixed precision, as Muon's authors do; float32 otherwise)."""
    x = matrix.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


def _whole_matrices_locally(tensor: DTensor) -> bool:
    """Whether each rank's shard holds whole matrices: a 3-D (experts, rows, cols) tensor split only over experts."""
    return tensor.ndim == 3 and all(isinstance(p, Replicate) or p == Shard(0) for p in tensor.placements)


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Newton-Schulz of ``update`` as one process would compute it, sharded like ``update``."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype).to(update.dtype)
    if _whole_matrices_locally(update):
        local = newton_schulz(update.to_local(), steps, dtype).to(update.dtype)
        return DTensor.from_local(
            local, update.device_mesh, update.placements, run_check=False, shape=update.shape, stride=update.stride()
        )
    whole = newton_schulz(update.full_tensor(), steps, dtype).to(update.dtype)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonAdamW(torch.optim.AdamW):
    """AdamW (torch's, fused where it can be) whose ``muon`` parameter group steps with Muon instead.

    One optimizer, so the learning-rate schedule, gradient clipping, checkpoints (``momentum_buffer`` beside AdamW's
    ``exp_avg`` / ``exp_avg_sq``) and everything else that takes "the optimizer" work unchanged.
    """

    def __init__(
        self,
        muon_params: list,
        adamw_groups: list[dict],
        *,
        momentum: float,
        ns_steps: int,
        ns_dtype: torch.dtype = torch.float32,
        **adamw,
    ):
        groups = [*adamw_groups, {"params": muon_params, "muon": True, "momentum": momentum, "ns_steps": ns_steps}]
        super().__init__([group for group in groups if group["params"]], **adamw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        every_group = self.param_groups
        for group in every_group:
            if group.get("muon"):
                self._muon_step(group)
        try:  # AdamW's own step over its groups only
            self.param_groups = [group for group in every_group if not group.get("muon")]
            super().step()
        finally:
            self.param_groups = every_group
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
                state["step"] = torch.zeros((), dtype=torch.float32)  # AdamW's load_state_dict wants one in every entry
            state["step"] += 1
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - momentum)
            nesterov = param.grad.lerp(buffer, momentum)
            direction = orthogonalize(nesterov, group["ns_steps"], self.ns_dtype)
            param.mul_(1 - lr * decay)
            param.add_(direction, alpha=-lr * RMS_MATCH * math.sqrt(max(param.shape[-2:])))


def muon_parameters(parts: list[nn.Module], adapter) -> list[nn.Parameter]:
    """The parameters Muon takes: every 2-D or 3-D (expert) weight of the decoder blocks of ``parts`` (the model, or
    a rank's pipeline stages) except MoE routers."""
    from meshtron.models.moe import moe_blocks, router_of

    chosen, routers = [], set()
    for part in parts:
        for _, block in adapter.named_blocks(part):
            routers.update(id(p) for _, moe in moe_blocks(block) for p in router_of(moe).parameters())
            chosen += [
                p
                for name, p in block.named_parameters()
                # gpt-oss's experts' biases ([E, 2I], [E, H]) are vectors per expert, not matrices
                if p.requires_grad and p.ndim in (2, 3) and id(p) not in routers and not name.endswith("_bias")
            ]
    unique = {id(p): p for p in chosen}
    return list(unique.values())
