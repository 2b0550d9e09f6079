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
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshtron.distributed.data_parallel import forget_forwards, reshard_all
from meshtron.distributed.precision import compute_head, release_compute_weights
from meshtron.metrics.memory import local_bytes
from meshtron.models.adapter import DecoderAdapter
from meshtron.train.batch import SequenceSplit, sequence_inputs
from meshtron.train.distill.targets import empty_targets, pack_targets
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
    def targets(self, input_ids: torch.Tensor, labels: torch.Tensor, bounds=None) -> torch.Tensor | None:
        """The micro-batch's targets (meshtron.train.distill.targets): ``labels`` (this rank's context-parallel
        shard) with the teacher's final hidden states of ``input_ids`` (this rank's rows, whole sequences: cut over the
        context-parallel ranks as the student's are; ``bounds``: their document bounds), ``(B, S / cp, H + w)``.
        Under pipeline parallelism: all the rows' on the last stage's rank (written microbatch by microbatch into
        one tensor), None on the others. Every FSDP module of the teacher but the head's is sharded again."""
        if self.runner is None:
            (model,) = self.modules
            target = pack_targets(labels, _whole(model(**sequence_inputs(input_ids, self.split, bounds))))
        else:
            target = self._pipeline_targets(input_ids, labels, bounds)
        self._reshard_all_but_head()
        return target

    def _pipeline_targets(self, input_ids, labels, bounds) -> torch.Tensor | None:
        runner = self.runner
        rows = [part.shape[0] for part in labels.tensor_split(runner.microbatches)]
        starts = [sum(rows[:micro]) for micro in range(len(rows))]
        written: list[torch.Tensor] = []  # the targets, made at the first microbatch's hidden states

        def on_last_stage(hidden: torch.Tensor, micro: int) -> None:
            hidden = _whole(hidden)
            if not written:
                written.append(empty_targets(labels, hidden.shape[-1], hidden.dtype))
            written[0][starts[micro] : starts[micro] + rows[micro], ..., : hidden.shape[-1]] = hidden

        with runner.stage_inputs.during(bounds) if runner.stage_inputs else contextlib.nullcontext():
            pipeline_forward(runner, input_ids, on_last_stage)
        return written[0] if written else None

    def _head_module(self) -> nn.Module | None:
        """The module that holds the teacher's head on this rank (None: a pipeline rank without the last stage)."""
        if self.runner is None:
            return self.modules[0]
        return self.modules[-1] if self.runner.holds_last else None

    def _reshard_all_but_head(self) -> None:
        """After the teacher's forward: FSDP keeps the root and (without ``fsdp.reshard_after_forward``, as under
        pipeline parallelism) every block gathered for a backward that never comes; only the head's module is needed
        until the student's loss (``release``)."""
        head_module = self._head_module()
        for module in self.modules:
            for part in module.modules():
                if isinstance(part, FSDPModule) and part is not head_module:
                    part.reshard()

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's head (weight, bias or None) in the compute dtype, as gathered by its forward; on the last
        stage's rank under pipeline parallelism."""
        head_module = self._head_module()
        if head_module is None:
            raise RuntimeError("the teacher's head is on the last pipeline stage's rank")
        return compute_head(head_module, self.adapter)

    def release(self) -> None:
        """Shard the teacher again after the student's loss used its head, and drop its compute-dtype weight copies:
        FSDP keeps the root gathered after a forward for a backward that never comes; its record of forwards, which
        only a backward clears, is dropped too."""
        release_compute_weights(*self.modules)
        reshard_all(*self.modules)
        forget_forwards(*self.modules)
