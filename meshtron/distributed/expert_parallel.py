"""Expert parallelism (EP) for transformers' mixture-of-experts blocks: dropless all-to-all token dispatch.

A transformers 5 MoE block (see meshtron.models.moe) routes with its own ``gate`` and then calls
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` on fused 3-D expert parameters
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. :func:`apply_expert_parallel` turns those
parameters into DTensors ``Shard(0)`` over a 1-D ``ep`` mesh (each EP rank owns ``E / ep`` consecutive
experts) and replaces the experts' forward by:

1. sort this rank's (token, slot) pairs by expert id (stable), count the pairs per expert;
2. exchange the per-expert counts (one all-to-all of ``E`` integers), which fixes the uneven splits (read on the
   host in one sync per forward; the forward runs eagerly under ``torch.compile``);
3. all-to-all the token rows to the ranks owning their experts;
4. regroup the received rows by local expert and run the local experts as grouped GEMMs
   (``torch._grouped_mm`` with offsets; a loop over local experts where it is unavailable):
   ``gate, up = (x @ gate_up_proj[e].T).chunk(2); y = (act(gate) * up) @ down_proj[e].T``
   (meshtron.models.experts; with LoRA's expert adapters, also split over experts, when the run has them);
5. all-to-all the results back, multiply by the routing weights and sum them per token (unpermuted to (token,
   slot) order, a sum over the slots: deterministic, where ``index_add`` on a GPU is not).

Dropless (no capacity factor: every routed pair is computed) and exact under autograd: gradients reach
the local tokens, the routing weights (hence the router) and the local expert shard. The routing is the
model's own, unchanged. An expert's gradient on its owner already sums the tokens of every EP rank, so
data parallelism must reduce it only over the ranks holding the same experts (the ``efsdp`` mesh and
``dp_replicate``), never over ``ep``: see :func:`meshtron.distributed.mesh.expert_meshes` and docs/moe.md,
"Expert parallelism".
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshtron.errors import ConfigError
from meshtron.models.experts import (
    combine,
    expert_math,
    inverse_permutation,
    local_expert_ffn,
    pair_rows,
    permute,
    sort_by_expert,
)
from meshtron.models.lora import expert_adapters
from meshtron.tensors import compile_disabled, local_tensor

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def shard_experts(experts: nn.Module, expert_fsdp_mesh, gradient_divide_factor: float, **fully_shard_kwargs) -> None:
    """FSDP of expert-parallel experts: ``fully_shard`` over ``expert_fsdp_mesh``
    (:func:`meshtron.distributed.mesh.expert_meshes`), dividing the reduced gradients by the *dense* parameters'
    factor (``dp_replicate * dp_shard * cp``, what FSDP divides the other gradients by), not by this mesh's size.

    Each rank's expert gradient already sums its EP group's tokens, so summing over ``expert_fsdp_mesh``
    covers every token once, and dividing by the dense factor gives the gradient of meshtron's loss
    (each rank's loss sum scaled by ``dp * cp / global targets``). Call it before ``fully_shard`` of the
    enclosing block (which then leaves the experts to this one). ``fully_shard_kwargs``: ``mp_policy``,
    ``offload_policy``, ``reshard_after_forward`` as for the block.

    The experts' inputs are not cast (``cast_forward_inputs=False``): the block's FSDP already casts the
    hidden states, and the routing weights keep the dtype the router gives them, as without EP.

    The reduce op: a divide factor other than the reduce-scatter group's size makes FSDP use
    ``PREMUL_SUM``, which gloo lacks, so over more than one rank the gradients are summed and then
    divided (``set_force_sum_reduction_for_comms``). Over a single-rank shard group (efsdp = 1) that
    setting is not used: torch 2.13 then divides by the factor twice (its no-reduce-scatter branch and the
    post-divide), whereas the default divides once without any reduce-scatter.
    """

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = fully_shard_kwargs.pop("mp_policy", None) or MixedPrecisionPolicy()
    fully_shard(
        experts,
        mesh=expert_fsdp_mesh,
        mp_policy=dataclasses.replace(policy, cast_forward_inputs=False),
        **fully_shard_kwargs,
    )
    experts.set_gradient_divide_factor(float(gradient_divide_factor))
    shard_size = expert_fsdp_mesh.size(expert_fsdp_mesh.ndim - 1)
    experts.set_force_sum_reduction_for_comms(shard_size > 1)


# ---------------------------------------------------------------------------------------------- EP


def check_expert_parallel(hf_config, ep: int) -> None:
    """Refuse, with one line and before any process group, an ep the model cannot be split by (the
    ``dp_shard x cp`` divisibility is checked by ``ParallelDims``)."""
    if ep == 1:
        return
    from meshtron.models.moe import is_moe, num_experts

    if not is_moe(hf_config):
        raise ConfigError(
            f"parallel.ep={ep} needs a mixture-of-experts model, and model family {hf_config.model_type} has no "
            "experts; set parallel.ep=1"
        )
    experts = num_experts(hf_config)
    if ep < 1 or experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} must divide the model's {experts} experts; use an ep that divides {experts}"
        )


def apply_expert_parallel_to_model(model: nn.Module, ep_mesh) -> None:
    """Expert parallelism for every MoE block ``model`` holds (meshtron.models.moe.moe_blocks)."""
    from meshtron.models.moe import moe_blocks

    for _, block in moe_blocks(model):
        apply_expert_parallel(block.experts, ep_mesh)


def apply_expert_parallel(experts: nn.Module, ep_mesh, use_grouped_mm: bool | None = None) -> nn.Module:
    """Shard ``experts`` (a transformers experts module: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I], ``act_fn``; or as its family's ``ExpertsAnatomy`` says, with biases [E, ...]) over the 1-D
    ``ep_mesh`` and make its forward the all-to-all dispatch.

    Every rank must hold the same full parameters beforehand (or meta tensors: then the shards are
    meta too, to be initialized later); each keeps rows ``[r * E/ep, (r+1) * E/ep)``. In place; returns
    ``experts``. The forward takes this rank's tokens (they differ per EP rank) and the model's routing.
    """
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallelism needs a 1-D mesh, got {ep_mesh.ndim}-D")
    ep = ep_mesh.size()
    num = experts.gate_up_proj.shape[0]
    if num % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the number of experts (num_experts={num}); change parallel.ep")
    for name in EXPERT_PARAMETERS:
        if isinstance(getattr(experts, name), DTensor):
            raise ValueError(f"experts.{name} is already a DTensor (expert parallelism applied twice?)")
    # The fused parameters, their biases (gpt-oss: [E, 2I], [E, H]) and any per-expert adapters (LoRA: [E, ...] like
    # them) keep this rank's experts.
    for name, param in list(experts.named_parameters()):
        if param.ndim >= 2 and param.shape[0] == num:
            owner, _, leaf = name.rpartition(".")
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.get_submodule(owner).register_parameter(
                leaf, nn.Parameter(sharded, requires_grad=param.requires_grad)
            )
    experts.ep_mesh = ep_mesh
    experts.num_global_experts = num
    experts.ep_use_grouped_mm = use_grouped_mm
    experts.last_dispatch = None
    experts.forward = types.MethodType(expert_parallel_forward, experts)
    return experts


@compile_disabled
def expert_parallel_forward(
    self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The EP forward of an experts module prepared by :func:`apply_expert_parallel`.

    One host sync per forward: every size the exchange and the local experts need (the send and receive splits, the
    rows per local expert) comes to the host in one ``tolist`` of one tensor. Run eagerly under ``torch.compile``
    (the decoder block around it is compiled): the splits are host integers that change with every batch's routing,
    on which dynamo would break the graph and recompile."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group = self.ep_mesh.get_group()
    ep = self.ep_mesh.size()
    num = self.num_global_experts
    gate_up, down = self.gate_up_proj, self.down_proj
    # Under FSDP the parameters come gathered over efsdp but still sharded over ep: this rank's experts.
    gate_up = local_tensor(gate_up)
    down = local_tensor(down)
    local = num // ep
    if gate_up.shape[0] != local:
        raise RuntimeError(f"experts hold {gate_up.shape[0]} experts on this rank, expected {num} / ep {ep} = {local}")

    order, token, counts = sort_by_expert(top_k_index, num)
    # counts_recv[src * local + e]: pairs rank src sends for this rank's local expert e.
    counts_recv = torch.empty_like(counts)
    dist.all_to_all_single(counts_recv, counts, group=group)
    counts_recv = counts_recv.view(ep, local)
    local_counts = counts_recv.sum(0)
    sizes = torch.cat([counts.view(ep, local).sum(1), counts_recv.sum(1), local_counts]).tolist()  # the one sync
    send_splits, recv_splits, host_counts = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
    self.last_dispatch = (send_splits, recv_splits)

    inverse = inverse_permutation(order)
    rows_in = pair_rows(hidden, order, token, top_k_index.shape[-1], inverse)
    received = all_to_all_single_autograd(rows_in.contiguous(), recv_splits, send_splits, group)
    # Received rows are source-major (src 0: its rows for local experts 0..L-1, src 1: ...): regroup by
    # local expert (stable, so within an expert rows stay in source order), run, and undo the regrouping.
    local_id = torch.arange(local, device=counts.device).repeat(ep)
    local_id = local_id.repeat_interleave(counts_recv.reshape(-1), output_size=sum(recv_splits))
    regroup = torch.argsort(local_id, stable=True)
    back = inverse_permutation(regroup)
    rows = local_expert_ffn(
        permute(received, regroup, back),
        gate_up,
        down,
        local_counts,
        expert_math(self, local_tensor),  # the family's layout, activation and (local) biases
        self.ep_use_grouped_mm,
        expert_adapters(self),
        host_counts=host_counts,
    )
    returned = all_to_all_single_autograd(permute(rows, back, regroup).contiguous(), send_splits, recv_splits, group)
    return combine(returned, order, top_k_weights, hidden.dtype, inverse)


# ---------------------------------------------------------------------------------------------- traffic


@dataclass
class AllToAllTraffic:
    """Rows and bytes of the EP all-to-alls of one MoE layer for a given routing (every EP rank's)."""

    rows: list[list[int]]
    """rows[src][dst]: (token, expert) pairs rank src dispatches to rank dst (src == dst stays local)."""
    row_bytes: int
    """Bytes of one hidden row (hidden size x element size)."""
    count_bytes: int
    """Bytes of the per-expert count exchange each rank sends (all of it, its own slice included)."""

    def sent_bytes(self, rank: int, backward: bool = True) -> int:
        """Hidden-row bytes ``rank`` sends to other ranks for one forward (dispatch + combine) and, with
        ``backward``, the backward too (the same two all-to-alls reversed, of gradients). The count exchange
        before each forward's dispatch (``count_bytes``) is not included."""
        dispatch = sum(n for dst, n in enumerate(self.rows[rank]) if dst != rank)
        combine_rows = sum(self.rows[src][rank] for src in range(len(self.rows)) if src != rank)
        total = (dispatch + combine_rows) * self.row_bytes
        return total * (2 if backward else 1)

    def received_bytes(self, rank: int, backward: bool = True) -> int:
        """Bytes ``rank`` receives from other ranks; by symmetry of dispatch and combine equal to sent."""
        return self.sent_bytes(rank, backward)

    def max_sent_bytes(self, backward: bool = True) -> int:
        """The busiest rank's bytes: what bounds the all-to-all time."""
        return max(self.sent_bytes(rank, backward) for rank in range(len(self.rows)))


def all_to_all_traffic(
    routing: list[torch.Tensor], num_experts: int, hidden_size: int, element_size: int
) -> AllToAllTraffic:
    """The EP all-to-all traffic of one MoE layer per step: ``routing[r]`` is EP rank r's ``top_k_index``
    (T_r, k); ``element_size``: bytes per element of the activations (2 for bf16)."""
    ep = len(routing)
    if num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the number of experts (num_experts={num_experts})")
    local = num_experts // ep
    rows = [torch.bincount(r.reshape(-1) // local, minlength=ep).tolist() for r in routing]
    return AllToAllTraffic(rows=rows, row_bytes=hidden_size * element_size, count_bytes=num_experts * 8)
