"""What the planner varies (a Layout) and what it keeps fixed (a Workload), and their link to a meshtron Config."""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import Config, ParallelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Workload:
    """The model-independent part of a run: sequence length, global batch and precision."""

    seq_len: int
    global_batch: int
    model_dtype: str = "float32"
    """Dtype of the stored parameters, gradients and AdamW state."""
    compute_dtype: str = "bfloat16"
    """Dtype FSDP gathers parameters in (``fsdp.param_dtype``); activations have it too. Without FSDP
    (dp x cp = 1) meshtron computes in ``model_dtype``."""
    mask_documents: bool = True

    @classmethod
    def from_config(cls, cfg: Config) -> "Workload":
        return cls(
            seq_len=cfg.data.seq_len,
            global_batch=cfg.train.global_batch_size,
            model_dtype=cfg.model.dtype,
            compute_dtype=cfg.fsdp.param_dtype or cfg.model.dtype,
            mask_documents=cfg.data.mask_documents,
        )


@dataclass(frozen=True)
class Layout:
    """One way to run a workload: the five degrees, the per-forward batch and the memory policies."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    """Sequences per forward on each data-parallel rank (a pipeline microbatch under pp > 1)."""
    activation_checkpointing: str = "none"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    cp_method: str = "ring"
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    pp_stage_layers: str | None = None

    @property
    def dims(self):
        """The degrees as meshtron's ParallelDims, which owns what they imply (dp, whether FSDP is on)."""
        from meshtron.distributed.mesh import ParallelDims

        world = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        return ParallelDims(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, world)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def fsdp_size(self) -> int:
        """Ranks each parameter is sharded over (dp_shard x cp); 1 means whole parameters."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dims.fsdp_enabled

    def local_batch(self, workload: Workload) -> int:
        return workload.global_batch // self.dp

    def microbatches(self, workload: Workload) -> int:
        """Forwards per optimizer step on one rank: accumulation steps, or pipeline microbatches."""
        return self.local_batch(workload) // self.micro_batch

    def parallel_config(self, workload: Workload | None = None) -> ParallelConfig:
        return ParallelConfig(
            dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, cp=self.cp, pp=self.pp,
            sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel, cp_method=self.cp_method,
            pp_schedule=self.pp_schedule, pp_stages_per_rank=self.pp_stages_per_rank if self.pp > 1 else None,
            pp_microbatches=self.microbatches(workload) if workload is not None and self.pp > 1 else None,
            pp_first_stage_layers=self.pp_first_stage_layers, pp_last_stage_layers=self.pp_last_stage_layers,
            pp_stage_layers=self.pp_stage_layers,
        )

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, hf_config) -> "Layout":
        """The layout a meshtron run of ``cfg`` on ``world_size`` processes uses (degrees and batch resolved)."""
        from meshtron.distributed.mesh import ParallelDims
        from meshtron.distributed.pipeline_parallel import check_pipeline, stages_per_rank
        from meshtron.train.trainer import micro_batch_plan

        dims = ParallelDims.from_config(cfg.parallel, world_size)
        micro, _ = micro_batch_plan(cfg, dims)
        p = cfg.parallel
        if dims.pp > 1:
            microbatches = check_pipeline(p, hf_config, micro, cfg.train.micro_batch_size is not None)
            micro = micro // microbatches
        return cls(
            dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp, pp=dims.pp,
            micro_batch=micro, activation_checkpointing=cfg.train.activation_checkpointing,
            sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel, cp_method=p.cp_method,
            pp_schedule=p.pp_schedule, pp_stages_per_rank=stages_per_rank(p) if dims.pp > 1 else 1,
            pp_first_stage_layers=p.pp_first_stage_layers, pp_last_stage_layers=p.pp_last_stage_layers,
            pp_stage_layers=p.pp_stage_layers,
        )
