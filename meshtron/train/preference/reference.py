"""The reference model of ``dpo`` / ``ipo``: the per-row log-probabilities of each pair's answers under the policy's
starting point, computed forward only for every micro-batch before the policy's forward and backward.

``preference.reference`` (meshtron.config.reference_kind):

* ``model``: a frozen copy of the starting weights, built, parallelized and materialized exactly as the policy is
  (the same layout: FSDP shards it, tensor parallelism splits it, pipeline parallelism cuts it into the same stages,
  context parallelism cuts its sequences), with no gradients and no optimizer state, in eval mode (TRL's reference
  is). Under pipeline parallelism it runs as a forward-only pipeline (meshtron.train.pipeline.evaluate).
* ``lora_base``: the policy itself with its LoRA adapters switched off (their scaling set to 0 for the forward):
  the base weights, no second copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.distributed.data_parallel import forget_forwards, reshard_all
from meshtron.distributed.precision import compute_head, release_compute_weights
from meshtron.metrics.memory import local_bytes
from meshtron.models.adapter import DecoderAdapter
from meshtron.train.batch import SequenceSplit, sequence_inputs
from meshtron.train.pipeline.evaluate import pipeline_forward
from meshtron.train.pipeline.runner import PipelineRunner
from meshtron.train.preference.head import HeadOptions, answer_logps


@contextlib.contextmanager
def adapters_off(modules: list[nn.Module]) -> Iterator[None]:
    """The LoRA adapters of ``modules`` contribute nothing inside (their output is scaled by 0: the base model's
    output exactly)."""
    adapted = [m for module in modules for m in module.modules() if hasattr(m, "lora_scaling")]
    scalings = [m.lora_scaling for m in adapted]
    for m in adapted:
        m.lora_scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(adapted, scalings):
            m.lora_scaling = scaling


@dataclass
class ReferenceModel:
    """Where the reference's log-probabilities come from: ``modules`` (the reference copy's, or for ``lora_base``
    the policy's own), run whole (``runner`` None) or as the pipeline stages of ``runner``."""

    kind: str
    """``model`` or ``lora_base``."""
    modules: list[nn.Module]
    adapter: DecoderAdapter
    head: HeadOptions
    split: SequenceSplit
    runner: PipelineRunner | None = None

    def param_bytes(self) -> int:
        """This rank's bytes of the reference's own parameters (their local shards): a ``model`` copy's; 0 for
        ``lora_base``, which is the policy."""
        if self.kind != "model":
            return 0
        return sum(local_bytes(p) for module in self.modules for p in module.parameters())

    def _switched(self):
        return adapters_off(self.modules) if self.kind == "lora_base" else contextlib.nullcontext()

    @torch.no_grad()
    def answer_logps(
        self, input_ids: torch.Tensor, labels: torch.Tensor, runs: torch.Tensor, bounds=None
    ) -> torch.Tensor:
        """(B, 2) summed log-probabilities of each row's chosen and rejected answers (whole over the
        context-parallel ranks). ``labels`` and ``runs``: this rank's context-parallel shard; ``bounds``: the
        micro-batch's document bounds (meshtron.train.batch.host_document_bounds). Under pipeline parallelism the
        result is on the last stage's rank (zeros elsewhere: only that rank's loss reads it)."""
        with self._switched():
            if self.runner is not None:
                result = self._pipeline(input_ids, labels, runs, bounds)
            else:
                (model,) = self.modules
                hidden = model(**sequence_inputs(input_ids, self.split, bounds))
                weight, bias = compute_head(model, self.adapter)
                result = answer_logps(hidden, labels, runs, weight, bias, self.head, self.split.cp_group)[0]
        if self.kind == "model":
            release_compute_weights(*self.modules)
        # FSDP keeps the root's and the last block's parameters gathered after forward for the backward that follows;
        # none follows here: a frozen copy would keep them gathered for the whole run, and the policy (lora_base)
        # must enter its training forward sharded, as after evaluation (reshard_all's docstring).
        reshard_all(*self.modules)
        if self.kind == "model":  # no backward ever clears a frozen copy's record of its forwards
            forget_forwards(*self.modules)
        return result

    def _pipeline(self, input_ids, labels, runs, bounds) -> torch.Tensor:
        runner = self.runner
        label_parts, run_parts = labels.tensor_split(runner.microbatches), runs.tensor_split(runner.microbatches)
        found: list[torch.Tensor] = []  # the last stage's, one per microbatch in order

        def on_last_stage(hidden: torch.Tensor, micro: int) -> None:
            weight, bias = runner.head()
            found.append(
                answer_logps(
                    hidden, label_parts[micro], run_parts[micro], weight, bias, self.head, self.split.cp_group
                )[0]
            )

        with runner.stage_inputs.during(bounds) if runner.stage_inputs else contextlib.nullcontext():
            pipeline_forward(runner, input_ids, on_last_stage)
        return torch.cat(found) if found else torch.zeros(input_ids.shape[0], 2, device=input_ids.device)


def freeze(modules: list[nn.Module]) -> None:
    """A reference copy: no parameter takes a gradient, eval mode (no dropout), as TRL's reference model."""
    for module in modules:
        module.requires_grad_(False)
        module.eval()
