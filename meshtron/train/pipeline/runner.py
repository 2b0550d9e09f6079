"""Pipeline-parallel training: this rank's stages under a torch schedule, one optimizer step at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.distributed.pipeline_parallel import (
    local_stage_ids,
    pipeline_schedule,
    set_stage_forward,
    split_layers,
)
from meshtron.distributed.precision import release_compute_weights
from meshtron.models.moe import num_experts
from meshtron.tensors import local_tensor
from meshtron.train.batch import SequenceSplit, StageInputs
from meshtron.train.loss.head import head_loss_sum
from meshtron.train.moe.pipeline_router_loss import PipelineRouterLoss, StageRouting, add_share, pipeline_router_values
from meshtron.train.moe.router_loss import router_coef, router_loss_enabled
from meshtron.train.pipeline.rehearsal import RehearsalStage, stage_shapes
from meshtron.train.preference.targets import PairCounts

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from meshtron.config import Config
    from meshtron.distributed.mesh import Meshes
    from meshtron.models.adapter import DecoderAdapter
    from meshtron.train.distill.head import DistillHead
    from meshtron.train.preference.head import PreferenceHead
    from meshtron.train.setup.run_setup import RunSetup


@dataclass
class PipelineRunner:
    """This rank's pipeline stages and their schedule; ``run`` does one optimizer step's forward and backward."""

    schedule: _PipelineSchedule | None
    """torch's schedule over this rank's stages (set by build_pipeline_runner)."""
    holds_first: bool
    holds_last: bool
    loss_parallel: bool
    head: Callable[[], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    """Gives the last stage's (head weight, bias) as they are at loss time."""
    compute_dtype: torch.dtype | None = None
    loss_chunk_size: int = 0
    compiled_loss: bool = False
    """Compile the fused loss's chunks (``train.compile``)."""
    softcap: float | None = None
    """The model's final logit soft-capping (Gemma 2), applied by the loss as without pipelining."""
    scale: float = 1.0
    tied_gradients: Callable[[], None] | None = None
    """Called after each step's backward: sums a tied model's embedding and head gradients
    (``meshtron.distributed.tied_embeddings``)."""
    router: PipelineRouterLoss | None = None
    """The MoE router load-balancing loss, when on (on every pipeline rank; only the last stage computes it)."""
    aux_scale: float = 0.0
    microbatches: int = 1
    pp_group: ProcessGroup | None = None
    lm_losses: list[torch.Tensor] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    """This rank's stage modules."""
    stage_ids: list[int] = field(default_factory=list)
    """Their stage ids, in increasing order."""
    stage_ranks: dict[int, int] = field(default_factory=dict)
    """Every stage's pipeline rank (meshtron.distributed.pipeline_parallel.local_stage_ids)."""
    stage_inputs: StageInputs | None = None
    """What the stages' forwards call for their model inputs (``run`` gives it the step's document bounds)."""
    preference: PreferenceHead | None = None
    """A preference objective's loss on the head (the targets are meshtron.train.preference.targets'), else None."""
    pair_counts: PairCounts | None = None
    """The step's global pair counts (a preference objective's; set by ``run``)."""
    rehearsal_inputs: dict[int, tuple] = field(default_factory=dict)
    """Under ``--rehearse`` (a fake process group): each of this rank's stages' inputs as meta tensors
    (meshtron.train.pipeline.rehearsal.stage_shapes), which forward-only passes make instead of receiving them."""
    distill: DistillHead | None = None
    """``train.objective=distill``'s loss on both heads (the targets are meshtron.train.distill.targets'), else
    None."""
    metric_sums: list[torch.Tensor] = field(default_factory=list)
    """A preference or distillation objective's metric sums of each microbatch of the step (the last stage's)."""

    def loss_fn(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Per microbatch: summed token loss, scaled so that the gradients add up to the global-mean loss's,
        plus this rank's scaled share of the router loss (``output`` then carries the routing statistics)."""
        hidden, carry = output if self.router is not None else (output, None)
        if self.preference is not None:
            weight, bias = self.head()
            loss, share, metrics = self.preference.loss(hidden, labels, weight, bias, self.pair_counts)
            self.lm_losses.append(local_tensor(share))
            self.metric_sums.append(metrics)
        elif self.distill is not None:
            loss, metrics = self.distill.loss(hidden, labels, *self.head())
            self.lm_losses.append(local_tensor(loss.detach()))
            self.metric_sums.append(metrics)
        else:
            loss = self.loss_sum(hidden, labels)
            self.lm_losses.append(local_tensor(loss.detach()))
        loss = loss * self.scale
        if carry is not None:
            loss = add_share(loss, self.router.micro_batch(carry).share * self.aux_scale)
        return loss

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's summed token loss of a microbatch (the caller holds loss parallel's context)."""
        weight, bias = self.head()
        return head_loss_sum(
            hidden,
            labels,
            weight,
            bias,
            compute_dtype=self.compute_dtype,
            chunk_size=self.loss_chunk_size,
            loss_parallel=self.loss_parallel,
            softcap=self.softcap,
            compiled=self.compiled_loss,
        )

    def run(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        scale: float,
        aux_scale: float = 0.0,
        document_bounds: tuple | None = None,
        pair_counts: PairCounts | None = None,
    ) -> torch.Tensor:
        """Forward and backward of the local batch; returns this rank's summed token loss (0 off the last stage).
        ``aux_scale``: what this rank's share of each microbatch's router loss is multiplied by;
        ``document_bounds``: the batch's (``meshtron.train.batch.host_document_bounds``), for every stage's
        forward; ``pair_counts``: a preference objective's global counts."""
        self.scale, self.aux_scale, self.lm_losses = scale, aux_scale, []
        self.pair_counts, self.metric_sums = pair_counts, []
        if self.router is not None:
            self.router.start_step()
        args = (input_ids,) if self.holds_first else ()
        kwargs = {"target": labels} if self.holds_last else {}
        # Loss parallel's context must cover the backward too, which the schedule runs inside step().
        bounds = self.stage_inputs.during(document_bounds) if self.stage_inputs else contextlib.nullcontext()
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext(), bounds:
            self.schedule.step(*args, **kwargs)
        release_compute_weights(*self.modules)  # the compute-dtype weight copies of this step
        if self.tied_gradients is not None:
            self.tied_gradients()
        # torch >= 2.13 may have called loss_fn once more first, on uninitialized tensors (shape inference).
        self.lm_losses = self.lm_losses[-self.microbatches :]
        self.metric_sums = self.metric_sums[-self.microbatches :]
        if self.router is not None:
            self.router.finish_step(self.microbatches)
        if not self.lm_losses:
            return torch.zeros((), device=input_ids.device)
        return torch.stack(self.lm_losses).sum()

    def step_metric_sums(self) -> torch.Tensor | None:
        """A preference or distillation objective's metric sums of the last step on this rank (None off the last
        stage, whose zeros the step's all-reduce supplies, and without such an objective)."""
        return torch.stack(self.metric_sums).sum(0) if self.metric_sums else None

    def router_values(self, device: torch.device) -> list[torch.Tensor]:
        """The step's (mean aux, max and min expert load) on every pipeline rank (meshtron.train.moe.router_loss)."""
        return pipeline_router_values(self.router, self.pp_group, device)


def build_pipeline_runner(
    stages: list[tuple[int, nn.Module]],
    adapter: DecoderAdapter,
    cfg: Config,
    setup: RunSetup,
    meshes: Meshes,
    device: torch.device,
    split: SequenceSplit,
    compute_dtype: torch.dtype | None = None,
    moe_layers=(),
    rehearsal: bool = False,
) -> tuple[nn.ModuleList, PipelineRunner]:
    """Wrap this rank's (parallelized, materialized) ``(stage id, module)`` pairs in pipeline stages and a schedule.
    ``moe_layers``: the whole model's decoder layers with a router (for the router load-balancing loss).
    ``rehearsal``: one rank on a fake process group (``meshtron.train.pipeline.rehearsal``): shapes given, not
    learned from the neighbours.

    Returns the stages as one module (for the optimizer and metrics) and the runner.
    """
    from torch.distributed.pipelining import PipelineStage

    dims = setup.dims
    pp_mesh = meshes.pp
    num_stages = len(split_layers(setup.hf_config.num_hidden_layers, cfg.parallel))
    tp_mesh = meshes.tp if dims.tp > 1 and cfg.parallel.sequence_parallel else None
    hf_config = setup.hf_config
    routes = router_loss_enabled(cfg.moe.router_aux_loss, hf_config)
    pipeline_stages = []
    rehearsal_inputs = {}
    stage_inputs = StageInputs(split)
    for stage_id, module in stages:
        first, last = stage_id == 0, stage_id == num_stages - 1
        routing = (
            StageRouting(module, hf_config, hf_config.num_hidden_layers, num_experts(hf_config)) if routes else None
        )
        set_stage_forward(module, adapter, first, last, stage_inputs, tp_mesh, routing)
        if rehearsal:
            inputs, outputs = stage_shapes(
                first,
                last,
                micro_batch=setup.batch.micro_batch_size,
                seq_len=cfg.data.seq_len,
                local_seq_len=cfg.data.seq_len // dims.cp // (dims.tp if tp_mesh is not None else 1),
                last_seq_len=cfg.data.seq_len // dims.cp,
                hidden_size=hf_config.hidden_size,
                dtype=compute_dtype or next(module.parameters()).dtype,
                carry_shape=(hf_config.num_hidden_layers, 2 * num_experts(hf_config) + 1) if routes else None,
            )
            rehearsal_inputs[stage_id] = inputs
            pipeline_stages.append(
                RehearsalStage(
                    module,
                    stage_id,
                    num_stages,
                    device,
                    input_args=inputs,
                    output_args=outputs,
                    group=pp_mesh.get_group(),
                )
            )
            continue
        pipeline_stages.append(PipelineStage(module, stage_id, num_stages, device, group=pp_mesh.get_group()))
    stage_ids = [stage_id for stage_id, _ in stages]
    last_module = dict(stages).get(num_stages - 1)
    runner = PipelineRunner(
        schedule=None,
        holds_first=0 in stage_ids,
        holds_last=last_module is not None,
        loss_parallel=dims.tp > 1 and cfg.parallel.loss_parallel,
        head=partial(adapter.head_parameters, last_module) if last_module is not None else None,
        compute_dtype=compute_dtype,
        loss_chunk_size=cfg.train.loss_chunk_size,
        compiled_loss=setup.compiled,
        softcap=adapter.logit_softcap(last_module) if last_module is not None else None,
        microbatches=setup.batch.pp_microbatches,
        pp_group=pp_mesh.get_group(),
        modules=[module for _, module in stages],
        stage_ids=[stage_id for stage_id, _ in stages],
        stage_ranks={stage: rank for rank in range(dims.pp) for stage in local_stage_ids(rank, cfg.parallel)},
        stage_inputs=stage_inputs,
        rehearsal_inputs=rehearsal_inputs,
    )
    if routes:
        dp_cp = meshes.dp_cp.get_group() if dims.dp * dims.cp > 1 else None
        runner.router = PipelineRouterLoss(router_coef(hf_config), num_experts(hf_config), moe_layers, dp_cp)
    runner.schedule = pipeline_schedule(pipeline_stages, cfg.parallel, setup.batch.pp_microbatches, runner.loss_fn)
    return nn.ModuleList([module for _, module in stages]), runner
