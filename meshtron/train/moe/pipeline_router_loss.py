"""The router load-balancing loss under pipeline parallelism: the routing statistics travel with the stages.

transformers' ``aux`` (meshtron.train.moe.router_loss) multiplies means over *every* MoE layer's tokens, while a
pipeline stage holds only some layers. So each microbatch carries, from stage to stage beside its hidden
states, a routing tensor of shape (layers, 2E + 1): per decoder layer the top-k assignment counts (E,
detached), the softmax probability sums (E, differentiable) and the tokens its router saw (0: a layer
without a router, or one a later stage holds). Each stage adds its own layers' rows; the last stage's loss
function reads the whole model's statistics from it, all-reduces the detached numbers over the dp x cp ranks
as without pipelining, and adds ``coef / A * share`` to the microbatch's loss (A: the step's pipeline
microbatches, which play the accumulation micro-batches' part). Backward then sends the share's gradient
with respect to every stage's probability sums back through the pipeline with the hidden states' gradient:
nothing else crosses stages, and the gradients are those of transformers' loss over the whole model.

The pipeline microbatch ``m`` of data-parallel rank ``r`` is that rank's slice of global micro-batch ``m``
(``train.step`` asks the sampler for microbatch-sized slices), so a one-process run with ``A`` accumulation
micro-batches sees the same global micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from meshtron.models.moe import layer_index
from meshtron.train.moe.router_loss import (
    LocalRouting,
    MicroBatchAux,
    RouterLoss,
    StepRouting,
    micro_batch_aux,
    reduce_routing,
)


class StageRouting:
    """One pipeline stage's routers: records them during the stage's forward and adds them to the carry."""

    def __init__(self, stage: torch.nn.Module, hf_config, num_layers: int, num_experts: int):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.recorder = RouterLoss(stage, hf_config, coef=0.0, allow_empty=True)
        self.layers = [layer_index(name) for name, _ in self.recorder.blocks]
        self._index = None  # the layers as a tensor on the compute device, made once (not per microbatch)

    def run(self, forward, carry: torch.Tensor | None, device: torch.device):
        """(``forward()``, the carry with this stage's layers added): ``forward`` runs the stage with its routers
        recorded; ``carry`` is the previous stage's (None on the first stage: a zero carry)."""
        if carry is None:
            carry = torch.zeros(self.num_layers, 2 * self.num_experts + 1, device=device)
        if not self.layers:
            return forward(), carry
        with self.recorder.recording():
            out = forward()
        local = self.recorder.take()
        tokens = local.tokens.reshape(1, 1).expand(len(self.layers), 1).to(local.prob_sums.dtype)
        rows = torch.cat([local.counts, local.prob_sums, tokens], dim=1)
        if self._index is None or self._index.device != rows.device:
            self._index = torch.tensor(self.layers, device=rows.device)
        return out, carry.index_add(0, self._index, rows.to(carry.dtype))

    def remove(self) -> None:
        self.recorder.remove()


def carried_routing(carry: torch.Tensor, moe_layers: list[int], num_experts: int) -> LocalRouting:
    """The whole model's LocalRouting of one microbatch on this rank, from the last stage's carry;
    ``moe_layers``: the decoder layers with a router, in order."""
    rows = carry[moe_layers]
    return LocalRouting(
        rows[:, :num_experts].detach(), rows[:, num_experts : 2 * num_experts], rows[0, 2 * num_experts].detach()
    )


class PipelineRouterLoss:
    """The last stage's side: each microbatch's global ``aux`` and this rank's share, and the step's numbers.

    torch >= 2.13 first runs the stages and the loss function once on uninitialized tensors to infer the
    transfers' shapes (all last-stage ranks together, so the all-reduce below matches); the step keeps the
    last ``microbatches`` calls' numbers, which are the schedule's real ones."""

    def __init__(self, coef: float, num_experts: int, moe_layers: list[int], group=None):
        self.coef = float(coef)
        self.num_experts = num_experts
        self.moe_layers = list(moe_layers)
        self.group = group
        self.calls: list[MicroBatchAux] = []
        self.step = StepRouting()

    def start_step(self) -> None:
        self.calls = []

    def finish_step(self, microbatches: int) -> None:
        self.step = StepRouting()
        for micro in self.calls[-microbatches:] if self.calls else []:
            self.step.add(micro)

    def micro_batch(self, carry: torch.Tensor) -> MicroBatchAux:
        """One all-reduce of the detached statistics over the dp x cp ranks, as without pipelining."""
        local = carried_routing(carry, self.moe_layers, self.num_experts)
        aux = micro_batch_aux(local, reduce_routing(local, self.group))
        self.calls.append(aux)
        return aux


def add_share(loss: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """``loss + share``; under loss parallel the LM loss is a DTensor and every tp rank holds the same share."""
    if isinstance(loss, DTensor):
        share = DTensor.from_local(share, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss + share


def pipeline_router_values(router: PipelineRouterLoss | None, pp_group, device: torch.device) -> list[torch.Tensor]:
    """``StepRouting.tensors()`` of the step on every pipeline rank: the last stage computed them, the others
    (rank 0, which logs, among them) get them from one small all-reduce over the pp group."""
    values = torch.zeros(3, device=device)
    if router is not None and router.step.micro_batches:
        values = torch.stack([t.float().to(device) for t in router.step.tensors()])
    dist.all_reduce(values, group=pp_group)
    return list(values.unbind())
