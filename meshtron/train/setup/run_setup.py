"""What preflight resolves for a run (``RunSetup``, with its ``BatchSplit``): the types every later stage reads, kept
apart from the checks that make them (meshtron.train.setup.preflight) so that the stages preflight calls can name
them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from meshtron.checkpoint.manager import CheckpointOptions
    from meshtron.config import Config, ModelConfig
    from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.distributed.parallelize import ParallelizeOptions
    from meshtron.distributed.precision import PrecisionPolicy
    from meshtron.errors import MeshtronError


@dataclass(frozen=True)
class BatchSplit:
    """How one data-parallel rank's share of the global batch is cut for an optimizer step, computed once by
    preflight (the words as in docs/pipeline-parallel.md): a *micro-batch* is what one forward and backward runs
    on. Without pipeline parallelism the rank accumulates the gradients of ``accumulation_steps`` micro-batches;
    under pipeline parallelism the schedule runs the rank's whole batch in one step as ``pp_microbatches``
    *pipeline microbatches*, each a micro-batch, without accumulation."""

    micro_batch_size: int
    """Sequences per forward and backward on a rank (``train.micro_batch_size`` resolved); under pipeline
    parallelism the size of a pipeline microbatch."""
    accumulation_steps: int = 1
    """Micro-batches whose gradients make one optimizer step (1 under pipeline parallelism)."""
    pp_microbatches: int = 1
    """Pipeline microbatches the schedule runs per step (1 without pipeline parallelism)."""

    @property
    def rank_batch(self) -> int:
        """Sequences each data-parallel rank trains per step (at the full global batch size)."""
        return self.micro_batch_size * self.accumulation_steps * self.pp_microbatches


@dataclass(kw_only=True)
class RunSetup:
    """Everything checked before any collective: resolved degrees, batch split, tokenizer and model config, and the
    settings resolved for the run's device (``auto`` and the like), once, for every later use."""

    dims: ParallelDims
    batch: BatchSplit
    tokenizer: ByteTokenizer | HFTokenizer
    hf_config: PretrainedConfig
    model: ModelConfig
    """``[model]`` resolved: a local folder absolute, a hub id pinned to the commit it was fetched at
    (``model.revision``; a resume keeps its checkpoint's). The run's settings take it (``resolved_config``)."""
    teacher_model: ModelConfig | None = None
    """``train.objective=distill``: the teacher's model settings (meshtron.models.teacher), else None."""
    teacher_config: PretrainedConfig | None = None
    """``train.objective=distill``: the teacher's Hugging Face config, at the student's vocabulary size."""
    precision: PrecisionPolicy
    """``precision.mixed_precision`` resolved (meshtron.distributed.precision)."""
    compiled: bool
    """``train.compile`` resolved: the decoder blocks and the fused loss's chunks are compiled."""
    attention_kernel: str
    """``model.attention_kernel`` resolved (``auto``: the device's), for whole-sequence document attention."""
    resume_from: Path | None = None
    """The checkpoint this run continues from."""
    resume_skipped: tuple[str, ...] = ()
    """Newer checkpoints ``checkpoint.resume=auto`` passed over as damaged, one line each."""
    tokenizer_notice: str | None = None
    """A line for rank 0 when a pretrained model trains on the byte tokenizer (meshtron.data.tokenizer)."""
    revision_notice: str | None = None
    """A line for rank 0 when a resume keeps the hub commit its checkpoint records while the hub's main moved on."""
    resume_agreed: bool = True
    """False in the workers of a multi-process run until ``agree_resume_point`` gave them rank 0's resume point."""
    resume_error: MeshtronError | None = None
    """Rank 0 of a multi-process run: the error its resolution of the resume point met, which
    ``agree_resume_point`` raises on every rank."""


def parallelize_options(cfg: Config, setup: RunSetup) -> ParallelizeOptions:
    """What meshtron.distributed.parallelize reads of ``cfg``, with preflight's resolution of precision and compile."""
    from meshtron.distributed.parallelize import ParallelizeOptions

    return ParallelizeOptions(
        parallel=cfg.parallel,
        fsdp=cfg.fsdp,
        precision=setup.precision,
        compiled=setup.compiled,
        static_shapes=cfg.train.objective == "distill",  # the teacher's blocks beside the student's
        float8=cfg.precision.float8,
        float8_recipe=cfg.precision.float8_recipe,
        mask_documents=cfg.data.mask_documents,
        mlp_tiles=cfg.train.mlp_tiles,
        activation_checkpointing=cfg.train.activation_checkpointing,
    )


def resolved_config(cfg: Config, setup: RunSetup) -> Config:
    """``cfg`` with what preflight resolved in it (``setup.model``): a new Config, ``cfg`` unchanged (a run's settings
    are never assigned to once preflight has run)."""
    return replace(cfg, model=setup.model)


def checkpoint_options(cfg: Config) -> CheckpointOptions:
    """What meshtron.checkpoint.manager reads of ``cfg`` (the settings preflight resolved: ``resolved_config``)."""
    from meshtron.checkpoint.manager import CheckpointOptions, checkpoint_directory, hub_revision, lora_base

    return CheckpointOptions(
        directory=checkpoint_directory(cfg.checkpoint, cfg.run.output_dir),
        resume=cfg.checkpoint.resume,
        data=cfg.data,
        global_batch_size=cfg.train.global_batch_size,
        lora_base=lora_base(cfg.model, cfg.train.seed) if cfg.lora.enabled else None,
        hub_revision=hub_revision(cfg.model),
    )
