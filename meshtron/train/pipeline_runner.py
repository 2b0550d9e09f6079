"""Pipeline-parallel training: this rank's stages under a torch schedule, one optimizer step at a time."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from meshtron.distributed.pipeline_parallel import pipeline_schedule, set_stage_forward, split_layers
from meshtron.distributed.tensor_parallel import local_value
from meshtron.train.batch import sequence_inputs
from meshtron.train.loss import head_loss_sum


@dataclass
class PipelineRunner:
    """This rank's pipeline stages and their schedule; ``run`` does one optimizer step's forward and backward."""

    schedule: object
    holds_first: bool
    holds_last: bool
    loss_parallel: bool
    head: object = None
    """A callable giving the last stage's (head weight, bias) as they are at loss time."""
    compute_dtype: torch.dtype | None = None
    loss_chunk_size: int = 0
    softcap: float | None = None
    """The model's final logit soft-capping (Gemma 2), applied by the loss as without pipelining."""
    scale: float = 1.0
    tied_gradients: object = None
    """Called after each step's backward: sums a tied model's embedding and head gradients
    (``meshtron.distributed.tied_embeddings``)."""

    def loss_fn(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per microbatch: summed token loss, scaled so that the gradients add up to the global-mean loss's."""
        weight, bias = self.head()
        loss = head_loss_sum(
            hidden, labels, weight, bias, compute_dtype=self.compute_dtype, chunk_size=self.loss_chunk_size,
            loss_parallel=self.loss_parallel, softcap=self.softcap,
        )
        return loss * self.scale

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        """Forward and backward of the local batch; returns this rank's summed token loss (0 off the last stage)."""
        self.scale = scale
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.holds_first else ()
        kwargs = {"target": labels, "losses": losses} if self.holds_last else {}
        # Loss parallel's context must cover the backward too, which the schedule runs inside step().
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            self.schedule.step(*args, **kwargs)
        if self.tied_gradients is not None:
            self.tied_gradients()
        if not losses:
            return torch.zeros((), device=input_ids.device)
        return torch.stack([local_value(loss.detach()) for loss in losses]).sum() / scale


def build_pipeline_runner(
    stages, adapter, cfg, plan, dims, meshes, device, split, compute_dtype=None
) -> tuple[nn.ModuleList, PipelineRunner]:
    """Wrap this rank's (parallelized, materialized) ``(stage id, module)`` pairs in pipeline stages and a schedule.

    Returns the stages as one module (for the optimizer and metrics) and the runner.
    """
    from torch.distributed.pipelining import PipelineStage

    pp_mesh = meshes["world"]["pp"]
    num_stages = len(split_layers(plan.hf_config.num_hidden_layers, cfg.parallel))
    tp_mesh = meshes["world"]["tp"] if dims.tp > 1 and cfg.parallel.sequence_parallel else None
    pipeline_stages = []
    for stage_id, module in stages:
        first, last = stage_id == 0, stage_id == num_stages - 1
        set_stage_forward(module, adapter, first, last, partial(sequence_inputs, split=split), tp_mesh)
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
        softcap=adapter.logit_softcap(last_module) if last_module is not None else None,
    )
    runner.schedule = pipeline_schedule(pipeline_stages, cfg.parallel, plan.pp_microbatches, runner.loss_fn)
    return nn.ModuleList([module for _, module in stages]), runner
