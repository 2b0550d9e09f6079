"""The teacher of ``train.objective=distill``: a frozen model of its own shape (depth, width, heads) built,
parallelized and materialized under the run's own layout, forward only.

FSDP shards it over the data-parallel ranks, tensor parallelism splits it with its own plan (its heads divide by
tp: meshtron.train.setup.preflight checks), context parallelism cuts its sequences as the student's, and under
pipeline parallelism it runs as a forward-only pipeline over the same number of stages (an even split of its own
layers) whose last stage is on the student's last stage's rank. Its final hidden states of a micro-batch (this
rank's context-parallel shard, whole over tp) go with the labels to the student's loss
(meshtron.train.distill.targets), where both heads are applied chunk by chunk (meshtron.train.loss.distill).

FSDP keeps the teacher's root (embeddings, final norm, head) gathered from its forward until ``release``, which
the step calls once the student's loss has used the teacher's head (after each micro-batch; under pipeline
parallelism after the schedule).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.distributed.data_parallel import forget_forwards, reshard_all
from meshtron.metrics.memory import local_bytes
from meshtron.models.adapter import DecoderAdapter
from meshtron.train.batch import SequenceSplit, sequence_inputs
from meshtron.train.pipeline.evaluate import pipeline_forward
from meshtron.train.pipeline.runner import PipelineRunner


def _whole(hidden: torch.Tensor) -> torch.Tensor:
    """A stage's final hidden states as a plain tensor, whole over tensor parallelism's sequence split."""
    return hidden.full_tensor() if isinstance(hidden, DTensor) else hidden


@dataclass
class TeacherModel:
    """The frozen teacher: ``modules`` run whole (``runner`` None) or as the pipeline stages of ``runner``."""

    name: str
    """``distill.teacher`` as the user gave it."""
    modules: list[nn.Module]
    adapter: DecoderAdapter
    split: SequenceSplit
    runner: PipelineRunner | None = None

    def param_bytes(self) -> int:
        """This rank's bytes of the teacher's parameters (their local shards)."""
        return sum(local_bytes(p) for module in self.modules for p in module.parameters())

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, bounds=None) -> torch.Tensor | None:
        """The teacher's final hidden states of ``input_ids`` (this rank's rows, whole sequences: cut over the
        context-parallel ranks as the student's are; ``bounds``: their document bounds), ``(B, S / cp, H)``. Under
        pipeline parallelism: all the rows' on the last stage's rank, None on the others."""
        if self.runner is None:
            (model,) = self.modules
            return _whole(model(**sequence_inputs(input_ids, self.split, bounds)))
        runner = self.runner
        found: list[torch.Tensor] = []  # the last stage's, one per microbatch in order
        with runner.stage_inputs.during(bounds) if runner.stage_inputs else contextlib.nullcontext():
            pipeline_forward(runner, input_ids, lambda hidden, micro: found.append(_whole(hidden)))
        return torch.cat(found) if found else None

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's head (weight, bias or None): as gathered by its forward; on the last stage's rank under
        pipeline parallelism."""
        if self.runner is not None:
            return self.runner.head()
        return self.adapter.head_parameters(self.modules[0])

    def release(self) -> None:
        """Shard the teacher again after the student's loss used its head: FSDP keeps the root (and the last block)
        gathered after a forward for a backward that never comes; its record of forwards, which only a backward
        clears, is dropped too."""
        reshard_all(*self.modules)
        forget_forwards(*self.modules)


def freeze(modules: list[nn.Module]) -> None:
    """No parameter takes a gradient; eval mode (no dropout, no router jitter)."""
    for module in modules:
        module.requires_grad_(False)
        module.eval()
