"""LoRA under tensor parallelism: each adapter split the way its projection is (meshtron.models.lora).

A column-parallel projection (its output features split) keeps ``A`` whole on every tp rank and splits ``B`` by
rows, so each rank computes its own output features' update from the same (replicated) input. A row-parallel
projection (its input features split) splits ``A`` by columns and keeps ``B`` whole: ``x_r A_r^T`` is one rank's
partial sum, ``B`` keeps it partial, and it is added to the projection's own partial output before the one
reduction the projection does anyway. So LoRA adds no collective. A k / v projection replicated on every rank
(fewer KV heads than tp) keeps both whole, as its weight is. The projection's parallel style is applied with its
adapters taken off (PyTorch's styles split every parameter under the module), then the adapters go back as
DTensors on the tp mesh, and the projection's forward (on DTensors, between its style's input and output hooks)
computes both.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from meshtron.models.lora import LORA_A, LORA_B, LoraLinear

ADAPTER_PLACEMENTS = {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(1), Replicate())}
"""(A's, B's) placement on the tp mesh by the projection's tensor-parallel role."""


def take_off_adapters(block: nn.Module, roles: dict[str, str]) -> dict[str, dict[str, nn.Module]]:
    """Remove the adapters (A, B and the dropout: every child) of the block's column- and row-parallel
    projections; {path: {child name: module}}."""
    taken = {}
    for path, role in roles.items():
        module = block.get_submodule(path)
        if isinstance(module, LoraLinear) and role in ("colwise", "kv_colwise", "rowwise"):
            taken[path] = dict(module._modules)
            module._modules.clear()
    return taken


def put_back_adapters(block: nn.Module, taken: dict, roles: dict[str, str], tp_mesh, kv_replicated: bool) -> None:
    """Give the (now parallel) projections their adapters back, split as ``ADAPTER_PLACEMENTS`` says."""
    for path, children in taken.items():
        role = roles[path]
        if role == "kv_colwise":
            role = "replicated" if kv_replicated else "colwise"
        placement_a, placement_b = ADAPTER_PLACEMENTS.get(role, (Replicate(), Replicate()))
        for name, placement in ((LORA_A, placement_a), (LORA_B, placement_b)):
            linear = children[name]
            weight = distribute_tensor(linear.weight.data, tp_mesh, [placement], src_data_rank=None)
            linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
        block.get_submodule(path)._modules.update(children)
