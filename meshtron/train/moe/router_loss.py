"""The mixture-of-experts load-balancing (router auxiliary) loss, as transformers defines it, over the global
micro-batch, whatever the layout.

transformers (``load_balancing_loss_func``, the same in Qwen3-MoE, Qwen2-MoE and Mixtral) takes every MoE
layer's router logits of one forward, ``softmax`` and ``top-k`` per token, and with ``N`` = tokens x layers::

    tokens_per_expert[e] = (top-k assignments to e, over all layers' tokens) / N
    router_prob[e]       = (sum of the softmax probability of e, over all layers' tokens) / N
    aux                  = E * sum_e tokens_per_expert[e] * router_prob[e]

and ``ForCausalLM`` adds ``router_aux_loss_coef * aux`` to the loss when ``output_router_logits``. The means
run over all layers' tokens together (not a per-layer sum); the assignment counts carry no gradient.

meshtron computes it over the *global micro-batch*: the sequences that all data-parallel and
context-parallel ranks process at one accumulation step (``GlobalBatchSchedule.local_micro_batches`` makes
that the same set of sequences a one-process run with the same accumulation processes). Per micro-batch:

* forward hooks on the routers (``moe_blocks(model)[i].gate``) record each layer's assignment counts
  (detached), its probability sums (differentiable) and its token count, only during the micro-batch's
  forward (when activation checkpointing recomputes a block in backward, they compute the same but keep
  nothing);
* one all-reduce over the dp x cp ranks (``dp_cp`` mesh) of the detached counts, probability sums and
  token count gives every rank the global ``tokens_per_expert``, ``N`` and the value of ``aux``;
* each rank's differentiable share is ``E * sum_e tokens_per_expert[e] * (its own probability sum of e) / N``:
  the shares add up to ``aux`` over the dp x cp ranks, so backward of ``coef / A * share`` scaled like the LM
  loss (``dp x cp`` times, as FSDP / DDP average gradients over the dp x cp ranks) gives the gradient of
  ``coef / A * aux`` summed once.

Tensor parallelism: the sparse MoE block runs whole on the gathered sequence on every tp rank, with plain
(local) router logits whose gradient is the whole gradient on each rank (``Replicate``); every tp rank
computes the same share and the all-reduce leaves the tp ranks out, so nothing is counted tp times.

The step's auxiliary loss is the mean over its ``A`` accumulation micro-batches of each global micro-batch's
``aux`` (as Hugging Face's Trainer averages per-micro-batch losses); the step's reported ``loss`` is the LM
loss (global token mean) plus ``coef`` times it, and ``aux_loss`` in metrics.jsonl is that mean, unscaled.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from meshtron.errors import ConfigError
from meshtron.models.moe import experts_per_token, has_own_router_bias, is_moe, moe_blocks, num_experts, router_of

if TYPE_CHECKING:
    from meshtron.distributed.mesh import Meshes
    from meshtron.train.setup.run_setup import RunSetup


def router_loss_enabled(setting: str, hf_config) -> bool:
    """Whether ``moe.router_aux_loss`` (``auto``, ``true``, ``false``) turns the loss on for this model;
    ``auto`` follows the model config's ``output_router_logits``, as transformers does."""
    if setting == "false":
        return False
    moe = is_moe(hf_config)
    if setting == "true" and not moe:
        raise ConfigError(
            "moe.router_aux_loss=true needs a mixture-of-experts model (num_experts > 0); "
            f"this {getattr(hf_config, 'model_type', 'model')} is dense. Use auto or false"
        )
    if setting == "true" and has_own_router_bias(hf_config):
        raise ConfigError(
            f"moe.router_aux_loss=true: {hf_config.model_type}'s routers score experts by sigmoid and are balanced "
            "by their own bias (transformers has no load-balancing loss for them); use moe.router_aux_loss=auto "
            "and moe.router_balance=auto (bias)"
        )
    return moe and (setting == "true" or bool(getattr(hf_config, "output_router_logits", False)))


@dataclass
class LocalRouting:
    """One micro-batch's routing statistics on this rank, per MoE layer (L layers, E experts)."""

    counts: torch.Tensor
    """(L, E) float32 top-k assignments per expert, no gradient."""
    prob_sums: torch.Tensor
    """(L, E) float32 sums of the softmax probabilities per expert, differentiable."""
    tokens: torch.Tensor
    """() float32 tokens the routers saw (per layer)."""


def layer_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts (E,) detached, probability sums (E,) differentiable) of one layer's router logits (..., E),
    with transformers' arithmetic: softmax in the logits' dtype, top-k of the probabilities, sums in float32."""
    experts = logits.shape[-1]
    probs = F.softmax(logits.reshape(-1, experts), dim=-1)
    with torch.no_grad():
        _, selected = torch.topk(probs, top_k, dim=-1)
        counts = torch.zeros(experts, dtype=torch.float32, device=logits.device)
        counts.scatter_add_(
            0, selected.reshape(-1), torch.ones(selected.numel(), dtype=torch.float32, device=logits.device)
        )
    return counts, probs.float().sum(dim=0)


def pack(local: LocalRouting) -> torch.Tensor:
    """The detached numbers the dp x cp ranks sum: counts (L*E), probability sums (L*E), tokens (1), in
    float64 (counts of a global micro-batch can pass float32's 2^24 exact integers)."""
    parts = [local.counts.reshape(-1), local.prob_sums.detach().reshape(-1), local.tokens.reshape(1)]
    return torch.cat([part.double() for part in parts])


def reduce_routing(local: LocalRouting, group=None) -> torch.Tensor:
    """``pack(local)`` summed over ``group`` (the dp x cp ranks; None: this process alone)."""
    packed = pack(local)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
    return packed


@dataclass
class MicroBatchAux:
    share: torch.Tensor
    """This rank's differentiable share of ``aux`` (the shares of the dp x cp ranks add up to it)."""
    aux: torch.Tensor
    """The global micro-batch's ``aux`` (detached, the same on every rank)."""
    counts: torch.Tensor
    """(L, E) global top-k assignments per layer and expert (detached)."""
    tokens: torch.Tensor
    """() global tokens of the micro-batch (per layer)."""


def micro_batch_aux(local: LocalRouting, reduced: torch.Tensor) -> MicroBatchAux:
    """The global micro-batch's ``aux`` and this rank's share of it, from the ``reduce_routing`` sums."""
    layers, experts = local.counts.shape
    size = layers * experts
    counts = reduced[:size].reshape(layers, experts)
    prob_sums = reduced[size : 2 * size].reshape(layers, experts)
    tokens = reduced[2 * size]
    rows = tokens * layers  # transformers' N: every layer's tokens
    tokens_per_expert = (counts.sum(0) / rows).float()
    rows = rows.float()
    share = experts * torch.sum(tokens_per_expert * local.prob_sums.sum(0)) / rows
    aux = experts * torch.sum(tokens_per_expert * (prob_sums.sum(0) / rows).float())
    return MicroBatchAux(share, aux, counts.float(), tokens.float())


class RouterLoss:
    """Records the routers of ``model``'s MoE blocks during each micro-batch's forward; see the module doc."""

    def __init__(self, model: torch.nn.Module, hf_config, coef: float, group=None, allow_empty: bool = False):
        self.blocks = moe_blocks(model)
        if not self.blocks and not allow_empty:  # allowed: a pipeline stage without MoE layers
            raise ConfigError("the router load-balancing loss found no MoE block (router gate + experts) in the model")
        self.num_experts = num_experts(hf_config)
        self.top_k = experts_per_token(hf_config)
        self.coef = float(coef)
        self.group = group
        self._recording = False
        self._layers: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._handles = [router_of(block).register_forward_hook(self._hook) for _, block in self.blocks]

    def _hook(self, module, args, output) -> None:
        # Activation checkpointing's recomputation in backward (not recording, grad on) runs the same ops, so
        # that the probabilities' backward finds the tensors it saved, but counts nothing again.
        if not (self._recording or torch.is_grad_enabled()):
            return
        logits = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(logits, DTensor):
            if not all(isinstance(p, Replicate) for p in logits.placements):
                raise ConfigError(f"router logits placed {logits.placements}: the router loss needs whole routers")
            logits = logits.to_local()
        counts, prob_sums = layer_routing(logits, self.top_k)
        if self._recording:
            self._layers.append((counts, prob_sums, logits.numel() // logits.shape[-1]))

    @contextlib.contextmanager
    def recording(self):
        """Around one micro-batch's forward: its routers' outputs are recorded."""
        self._layers = []
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def take(self) -> LocalRouting:
        """The recorded micro-batch's statistics (and forget them)."""
        if len(self._layers) != len(self.blocks):
            raise RuntimeError(f"recorded {len(self._layers)} router outputs for {len(self.blocks)} MoE blocks")
        counts, prob_sums, tokens = zip(*self._layers)
        self._layers = []
        if len(set(tokens)) != 1:
            raise RuntimeError(f"MoE layers saw different token counts {tokens}")
        # A fill on the device, not torch.tensor(): no blocking host-to-device copy per micro-batch.
        return LocalRouting(torch.stack(counts), torch.stack(prob_sums), counts[0].new_full((), float(tokens[0])))

    def micro_batch(self) -> MicroBatchAux:
        """After a micro-batch's forward: its global ``aux`` and this rank's share (one all-reduce)."""
        local = self.take()
        return micro_batch_aux(local, reduce_routing(local, self.group))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class StepRouting:
    """The step's router numbers: the mean of the micro-batches' ``aux`` and the expert load."""

    def __init__(self):
        self.aux_sum = None
        self.counts = None
        self.micro_batches = 0

    def add(self, micro: MicroBatchAux) -> None:
        self.aux_sum = micro.aux if self.aux_sum is None else self.aux_sum + micro.aux
        self.counts = micro.counts if self.counts is None else self.counts + micro.counts
        self.micro_batches += 1

    def tensors(self) -> list[torch.Tensor]:
        """(mean aux, max and min tokens per expert over the mean, over every layer and expert) for host_values."""
        mean = self.counts.sum(-1, keepdim=True) / self.counts.shape[-1]  # per layer: k x tokens / E
        load = self.counts / mean.clamp_min(1)
        return [self.aux_sum / self.micro_batches, load.max(), load.min()]


def router_metrics(values: list[float]) -> dict:
    """The metrics.jsonl entries of ``StepRouting.tensors()``'s values."""
    aux, load_max, load_min = values
    return {"aux_loss": aux, "expert_load_max": load_max, "expert_load_min": load_min}


def router_coef(hf_config) -> float:
    """The model's ``router_aux_loss_coef`` (transformers' default 0.001 when the config has none)."""
    return float(getattr(hf_config, "router_aux_loss_coef", 0.001))


def build_router_loss(model, setup: RunSetup, cfg, meshes: Meshes | None) -> RouterLoss | None:
    """The run's RouterLoss, or None when moe.router_aux_loss leaves it off (a dense model, or auto with
    the model config's output_router_logits false) or pipeline stages compute it
    (meshtron.train.moe.pipeline_router_loss)."""
    dims, hf_config = setup.dims, setup.hf_config
    if dims.pp > 1 or not router_loss_enabled(cfg.moe.router_aux_loss, hf_config):
        return None
    group = meshes.dp_cp.get_group() if meshes is not None and dims.dp * dims.cp > 1 else None
    return RouterLoss(model, hf_config, router_coef(hf_config), group)
