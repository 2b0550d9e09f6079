"""Auxiliary-loss-free load balancing of mixture-of-experts routers (``moe.router_balance=bias``).

As DeepSeek-V3 does (Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"): each MoE
layer's router gets a per-expert bias ``b`` (a float32 buffer, ``gate.balance_bias``, no gradient) that is added to
the routing scores for the *choice* of the top-k experts only; the weights the chosen experts' outputs are mixed
with stay the router's own (softmax probabilities, renormalized where the family does; gpt-oss's ``router``: the
bias is added to its logits, and the weights stay the softmax over the chosen experts' logits). After every
optimizer step each layer's bias moves against its load::

    load[e] = tokens routed to expert e in the step (all micro-batches, all data- and context-parallel ranks)
    b[e]   += moe.router_bias_rate * sign(mean(load) - load[e])

so overloaded experts become less likely to be chosen and idle ones more. The load is summed over the step's
micro-batches on each rank and then over the ``dp x cp`` ranks (one all-reduce of ``layers x experts`` numbers per
step), so every rank applies the same update and the biases are the same under every layout (tensor-parallel ranks
route the same tokens and are not counted twice; expert parallelism routes before it dispatches). The biases are
persistent buffers: checkpoints hold them; ``meshtron export`` leaves them out (transformers' model has no such
weight). Only tokens of training forwards count (not evaluation, not activation checkpointing's recomputation, not a
pipeline's shape-inference forward). Under a pipeline each stage moves its own layers' biases.
"""

from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.errors import ConfigError
from meshtron.models.moe import (
    MODEL_ROUTER_BIAS,
    experts_anatomy,
    has_own_router_bias,
    is_moe,
    moe_blocks,
    num_experts,
    router_of,
)
from meshtron.models.moe import ROUTER_BIAS as BIAS
from meshtron.tensors import local_tensor

if TYPE_CHECKING:
    from meshtron.distributed.mesh import Meshes
    from meshtron.train.setup.run_setup import RunSetup


def biased_router_forward(self, hidden_states):
    """transformers' top-k router (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) with the balancing bias in the choice."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    with torch.no_grad():
        _, router_indices = torch.topk(router_probs + getattr(self, BIAS), self.top_k, dim=-1)
    router_top_value = router_probs.gather(-1, router_indices)
    # Mixtral always renormalizes the top-k and keeps them in float32; the others renormalize if configured and
    # return the logits' dtype.
    renormalize = getattr(self, "norm_topk_prob", True)
    if renormalize:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    if hasattr(self, "norm_topk_prob"):
        router_top_value = router_top_value.to(router_logits.dtype)
    _record_load(self, router_indices)
    return router_logits, router_top_value, router_indices


def biased_top_k_softmax_forward(self, hidden_states):
    """gpt-oss's router (``GptOssTopKRouter``: logits with a bias, a softmax over the top-k logits) with the
    balancing bias in the choice only: the weights are the softmax over the chosen experts' own logits."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    with torch.no_grad():
        _, router_indices = torch.topk(router_logits + getattr(self, BIAS), self.top_k, dim=-1)
    router_scores = F.softmax(router_logits.gather(-1, router_indices), dim=1, dtype=router_logits.dtype)
    _record_load(self, router_indices)
    return router_logits, router_scores, router_indices


def counting_router_forward(self, hidden_states):
    """A router that chooses with a balancing bias of its own (DeepSeek-V3's ``e_score_correction_bias``): its own
    forward, with the tokens per expert counted."""
    router_logits, weights, indices = type(self).forward(self, hidden_states)
    _record_load(self, indices)
    return router_logits, weights, indices


def _record_load(router, indices: torch.Tensor) -> None:
    """Count a forward's choices towards the step's load. Training forwards only: not evaluation (not recording),
    not activation checkpointing's recomputation or a pipeline schedule's backward (inside autograd's backward)."""
    if router.balance_recording and torch._C._current_graph_task_id() == -1:
        load = torch.zeros(router.balance_experts, dtype=torch.float32, device=indices.device)
        load.index_add_(0, indices.reshape(-1), torch.ones(indices.numel(), device=load.device))
        router.balance_forwards.append(load)


def bias_of(router) -> torch.Tensor:
    """The router's balancing bias (the model's own or meshtron's), as this rank holds it."""
    own = getattr(router, MODEL_ROUTER_BIAS, None)
    return local_tensor(own if own is not None else getattr(router, BIAS))


class RouterBalance:
    """The balancing biases of the routers in ``parts`` (the model, or this rank's pipeline stages) and their update.
    ``group``: the dp x cp ranks whose loads add up; ``pp_group``: the pipeline ranks whose spreads are combined for
    the metrics (each holds some layers). ``device``: the run's compute device, where the biases live and every
    tensor this communicates is (NCCL refuses CPU tensors; a pipeline stage without MoE layers communicates too,
    and under ``fsdp.cpu_offload`` the routers' weights are on the CPU); None: the first router weight's device."""

    def __init__(
        self,
        parts,
        hf_config,
        rate: float,
        group=None,
        pp_group=None,
        forwards_per_step: int | None = None,
        device: torch.device | None = None,
    ):
        blocks = [block for part in parts for _, block in moe_blocks(part)]
        self.routers = [router_of(block) for block in blocks]
        anatomies = [experts_anatomy(block.experts) for block in blocks]
        if not self.routers and pp_group is None:  # a pipeline stage may hold no MoE layer
            raise ConfigError("moe.router_balance=bias found no MoE router (gate + experts) in the model")
        if device is None:  # installed after parallelization: FSDP / TP DTensors
            device = local_tensor(self.routers[0].weight).device if self.routers else torch.device("cpu")
        self.device = torch.device(device)
        self.rate = float(rate)
        self.group, self.pp_group = group, pp_group
        # Under a pipeline a step's forwards are its microbatches; torch.distributed.pipelining may run one more
        # before them in the first step (shape inference, on uninitialized inputs), which must not count.
        self.forwards_per_step = forwards_per_step
        self.experts = experts = num_experts(hf_config)
        for router, anatomy in zip(self.routers, anatomies):
            router.balance_forwards = []  # per training forward: tokens per expert
            router.balance_recording = False
            router.balance_experts = experts
            if anatomy.own_balance_bias:  # DeepSeek-V3: the router already chooses with its bias; count its choices
                router.forward = types.MethodType(counting_router_forward, router)
                continue
            if not all(hasattr(router, name) for name in ("weight", "top_k", "hidden_dim")):
                raise ConfigError(
                    f"moe.router_balance=bias: the {type(router).__name__} router is not a top-k softmax router "
                    "meshtron can bias; set moe.router_balance=aux_loss"
                )
            router.register_buffer(BIAS, torch.zeros(experts, dtype=torch.float32, device=self.device))
            # The family's routing: top-k of a softmax, or a softmax of the top-k (gpt-oss).
            forward = biased_top_k_softmax_forward if anatomy.top_k_softmax else biased_router_forward
            router.forward = types.MethodType(forward, router)

    @contextlib.contextmanager
    def recording(self):
        """Around one training micro-batch's forward: the tokens its routers choose count towards the load."""
        for router in self.routers:
            router.balance_recording = True
        try:
            yield
        finally:
            for router in self.routers:
                router.balance_recording = False

    def update(self) -> torch.Tensor:
        """After the optimizer step: the step's global load per layer (L, E) of this rank's layers, and every bias
        moved against it."""
        if not self.routers:
            return torch.zeros(0, self.experts, device=self.device)
        kept = -self.forwards_per_step if self.forwards_per_step else 0
        zero = torch.zeros(self.experts, dtype=torch.float32, device=self.device)
        load = torch.stack([sum(router.balance_forwards[kept:], zero) for router in self.routers])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(load, group=self.group)
        mean = load.mean(dim=-1, keepdim=True)
        with torch.no_grad():
            for router, step in zip(self.routers, torch.sign(mean - load) * self.rate):
                bias = bias_of(router)
                bias.add_(step.to(bias.device))
                router.balance_forwards.clear()
        return load

    def discard(self) -> None:
        """A skipped step (non-finite loss, fp16 overflow): its load is forgotten and no bias moves."""
        for router in self.routers:
            router.balance_forwards.clear()

    def spread(self, load: torch.Tensor) -> list[float]:
        """[max, min] of ``load_spread`` over every layer of the model (the pipeline ranks' layers combined)."""
        if self.pp_group is None:
            return load_spread(load).tolist()
        if load.numel():  # (max, -min): one MAX all-reduce gives both
            local = load_spread(load.to(self.device))
            extremes = torch.stack([local[0], -local[1]])
        else:  # a stage without MoE layers: neutral (0, -inf), made on the device (no copy from the host)
            extremes = torch.zeros(2, device=self.device)
            extremes[1] = -float("inf")
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.pp_group)
        high, low = extremes.tolist()
        return [high, -low]


def load_spread(load: torch.Tensor) -> torch.Tensor:
    """(max, min) over layers and experts of each expert's load over its layer's mean load."""
    relative = load / load.mean(dim=-1, keepdim=True).clamp_min(1)
    return torch.stack([relative.max(), relative.min()])


def resolve_router_balance(setting: str, hf_config) -> str:
    """``moe.router_balance`` for this model: ``auto`` is the model's own method, ``bias`` for a family whose
    routers have a balancing bias (DeepSeek-V3), else ``aux_loss``."""
    if setting != "auto":
        return setting
    return "bias" if is_moe(hf_config) and has_own_router_bias(hf_config) else "aux_loss"


def check_router_balance(setting: str, hf_config) -> None:
    """Refuse, before any process group, bias balancing for a model without experts."""
    setting = resolve_router_balance(setting, hf_config)
    if setting == "bias" and not is_moe(hf_config):
        raise ConfigError(
            "moe.router_balance=bias needs a mixture-of-experts model (num_experts > 0); this "
            f"{getattr(hf_config, 'model_type', 'model')} is dense. Use moe.router_balance=aux_loss"
        )


def build_router_balance(
    parts, setup: RunSetup, cfg, meshes: Meshes | None, device: torch.device | None = None
) -> RouterBalance | None:
    """The run's RouterBalance under ``moe.router_balance=bias`` (None otherwise); ``parts``: this rank's model
    parts (its pipeline stages); ``device``: the run's compute device."""
    dims = setup.dims
    if resolve_router_balance(cfg.moe.router_balance, setup.hf_config) != "bias":
        return None
    group = meshes.dp_cp.get_group() if meshes is not None and dims.dp * dims.cp > 1 else None
    pp_group = meshes.pp.get_group() if dims.pp > 1 else None
    forwards = setup.batch.pp_microbatches if dims.pp > 1 else None
    return RouterBalance(parts, setup.hf_config, cfg.moe.router_bias_rate, group, pp_group, forwards, device)
