"""What the planner varies (a Layout) and what it keeps fixed (a Workload), and their link to a meshtron Config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.config import Config, ParallelConfig
from meshtron.distributed.mesh import ParallelDims
from meshtron.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""``precision.mixed_precision`` values and the compute dtype each one means."""


def config_compute_dtype(cfg: Config, device: str = "cuda") -> str:
    """The dtype a run of ``cfg`` on ``device`` computes in (``precision.mixed_precision`` resolved as
    ``meshtron.distributed.precision`` resolves it; ``auto`` on CUDA assumes a GPU with bf16, as every
    planner GPU has)."""
    from meshtron.distributed.precision import resolve_mixed_precision

    setting = cfg.precision.mixed_precision
    name = resolve_mixed_precision(setting, device, bf16_supported=True)
    if name == "none" or (cfg.model.dtype != "float32" and setting == "auto"):
        return cfg.model.dtype
    return MIXED_PRECISION_DTYPES[name]


@dataclass(frozen=True)
class Workload:
    """The model-independent part of a run: sequence length, global batch, precision, loss chunking, device."""

    seq_len: int
    global_batch: int
    model_dtype: str = "float32"
    """Dtype of the stored parameters, gradients and AdamW state."""
    compute_dtype: str = "bfloat16"
    """Dtype the forward and backward compute in, in every layout (``precision.mixed_precision``); activations
    have it. Equal to ``model_dtype`` means no mixed precision."""
    mask_documents: bool = True
    loss_chunk_size: int = 4096
    """``train.loss_chunk_size``: tokens per chunk of the head + cross-entropy (0: one chunk)."""
    device: str = "cuda"
    """``cuda`` (what the planner plans) or ``cpu`` (the test suite's runs, whose document-masked attention
    is SDPA with a dense mask instead of FlexAttention)."""
    accumulate_unsharded: bool = False
    """``fsdp.accumulate_unsharded``: FSDP holds full gradients between accumulated micro-batches and
    reduce-scatters once per step (False: a reduce-scatter per micro-batch, only shards held)."""
    compiled: bool = True
    """``train.compile``: compiled decoder blocks (``auto`` compiles on CUDA): matmul-heavy steps run at
    ``Hardware.compiled_matmul_efficiency`` instead of ``matmul_efficiency``."""
    attn_implementation: str = "sdpa"
    """``model.attn_implementation`` (``eager`` for a family that cannot use sdpa, as Gemma 2)."""
    optimizer: str = "adamw"
    """``optimizer.name``: its registry entry (meshtron.train.optim.registry) says what state it keeps and what its
    step costs (under ``muon`` the blocks' matrices keep one momentum buffer, not AdamW's two moments)."""
    optimizer_settings: Any = None
    """The optimizer's own settings (``[optimizer.<name>]``, meshtron.train.optim.registry); None: its defaults."""
    float8: bool = False
    """``precision.float8``: the blocks' linears multiply in float8 (the GPU's float8 rate; compiled blocks keep
    the linears' inputs as their float8 casts)."""
    float8_recipe: str = "tensorwise"
    """``precision.float8_recipe``: how fast the float8 matmuls run (``calibration.FLOAT8_MATMUL_RATE``)."""
    mlp_tiles: int = 0
    """``train.mlp_tiles``: each dense MLP keeps only its input for backward (meshtron.models.tiled_mlp)."""
    activation_offload: bool = False
    """``train.activation_offload``: what autograd keeps for backward lives in host memory between the forward and
    the backward (meshtron.train.activation_offload)."""
    cpu_offload: bool = False
    """``fsdp.cpu_offload``: parameters, gradients and optimizer state in host memory (FSDP, over one rank in a
    world of one); layouts without FSDP are refused with it, as preflight does."""

    def __post_init__(self):
        if self.compute_dtype != self.model_dtype and self.compute_dtype not in MIXED_PRECISION_DTYPES.values():
            raise ConfigError(
                f"compute dtype {self.compute_dtype} with model dtype {self.model_dtype}: "
                f"mixed precision computes in {' or '.join(MIXED_PRECISION_DTYPES.values())}"
            )

    @property
    def mixed_precision(self) -> str:
        """The ``precision.mixed_precision`` value that runs this workload."""
        if self.compute_dtype == self.model_dtype:
            return "none"
        return next(name for name, dtype in MIXED_PRECISION_DTYPES.items() if dtype == self.compute_dtype)

    @classmethod
    def from_config(cls, cfg: Config, device: str = "cuda") -> "Workload":
        """The workload of ``cfg`` run on ``device`` (``cpu`` to compare with the test suite's CPU runs)."""
        from meshtron.distributed.parallelize import compile_enabled

        # Here, not at the top: the registry imports torch, which `meshtron --help` and `meshtron data` never need.
        from meshtron.train.optim.registry import optimizer_settings

        return cls(
            seq_len=cfg.data.seq_len,
            global_batch=cfg.train.global_batch_size,
            model_dtype=cfg.model.dtype,
            compute_dtype=config_compute_dtype(cfg, device),
            mask_documents=cfg.data.mask_documents,
            loss_chunk_size=cfg.train.loss_chunk_size,
            device=device,
            accumulate_unsharded=cfg.fsdp.accumulate_unsharded,
            compiled=compile_enabled(cfg.train.compile, device),
            attn_implementation=cfg.model.attn_implementation,
            optimizer=cfg.optimizer.name,
            optimizer_settings=optimizer_settings(cfg.optimizer),
            float8=cfg.precision.float8,
            float8_recipe=cfg.precision.float8_recipe,
            mlp_tiles=cfg.train.mlp_tiles,
            activation_offload=cfg.train.activation_offload,
            cpu_offload=cfg.fsdp.cpu_offload,
        )


PARALLEL_CHOICES = (
    "sequence_parallel",
    "loss_parallel",
    "cp_method",
    "cp_ulysses",
    "pp_schedule",
    "pp_first_stage_layers",
    "pp_last_stage_layers",
    "pp_stage_layers",
)
"""The ``[parallel]`` settings a Layout holds under the same name (besides its degrees, ``dims``)."""


@dataclass(frozen=True)
class Layout:
    """One way to run a workload: the degrees (``dims``), the per-forward batch and the memory policies."""

    dims: ParallelDims = ParallelDims()
    """The degrees, as meshtron resolves them; ``dims.ep`` is the expert-parallel degree (``parallel.ep``, mixtures
    of experts only): ranks borrowed from ``dp_shard x cp``, each holding ``E / ep`` experts and receiving the
    tokens routed to them (meshtron.distributed.expert_parallel). Not a mesh dimension: the world size does not
    change."""
    micro_batch: int = 1
    """Sequences per forward on each data-parallel rank (a pipeline microbatch under pp > 1)."""
    activation_checkpointing: str = "none"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    cp_method: str = "ring"
    cp_ulysses: int = 0
    """``parallel.cp_ulysses``: under ``cp_method=hybrid`` the all-to-all degree inside each group of consecutive cp
    ranks (the ring runs across the ``cp / cp_ulysses`` groups); 0 otherwise."""
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    pp_stage_layers: str | None = None

    @property
    def dp_replicate(self) -> int:
        return self.dims.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.dims.dp_shard

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def ep(self) -> int:
        return self.dims.ep

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
    def efsdp_size(self) -> int:
        """Ranks each expert parameter is sharded over under expert parallelism: ``dp_shard x cp / ep``
        (the ``efsdp`` mesh; ``fsdp_size`` without EP)."""
        return max(1, self.fsdp_size // self.ep)

    @property
    def fsdp_enabled(self) -> bool:
        return self.dims.fsdp_enabled

    def local_batch(self, workload: Workload) -> int:
        return workload.global_batch // self.dp

    def microbatches(self, workload: Workload) -> int:
        """Forwards per optimizer step on one rank: accumulation steps, or pipeline microbatches."""
        return self.local_batch(workload) // self.micro_batch

    def parallel_config(self, workload: Workload | None = None) -> ParallelConfig:
        return self.dims.to_config(
            **{name: getattr(self, name) for name in PARALLEL_CHOICES},
            pp_stages_per_rank=self.pp_stages_per_rank if self.pp > 1 else None,
            pp_microbatches=self.microbatches(workload) if workload is not None and self.pp > 1 else None,
        )

    def check(self, hf_config, workload: Workload) -> None:
        """Raise ConfigError where ``meshtron train``'s preflight would refuse this layout for ``hf_config`` and
        ``workload``: the degrees (``ParallelDims.from_config``: their product, ``ep`` dividing ``dp_shard x cp``)
        and ``check_layout``, the checks preflight runs (family, experts, context, attention, pipeline, tensor)."""
        from meshtron.config import FSDPConfig
        from meshtron.distributed.data_parallel import check_data_parallel
        from meshtron.distributed.layout_checks import check_layout

        parallel = self.parallel_config(workload)
        check_data_parallel(FSDPConfig(cpu_offload=workload.cpu_offload), self.dims)
        check_layout(
            hf_config,
            parallel,
            ParallelDims.from_config(parallel, self.world_size),
            seq_len=workload.seq_len,
            mask_documents=workload.mask_documents,
            attn_implementation=workload.attn_implementation,
            local_batch=self.local_batch(workload),
            micro_batch_size=None,  # the planner's micro_batch is the pipeline microbatch: pp_microbatches says it
            device_type=workload.device,
        )

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, hf_config) -> "Layout":
        """The layout a meshtron run of ``cfg`` on ``world_size`` processes uses (degrees and batch resolved)."""
        from meshtron.distributed.pipeline_parallel import check_pipeline, stages_per_rank
        from meshtron.train.preflight import micro_batch_split

        dims = ParallelDims.from_config(cfg.parallel, world_size)
        micro, _ = micro_batch_split(cfg, dims)
        p = cfg.parallel
        if dims.pp > 1:
            microbatches = check_pipeline(p, hf_config, micro, cfg.train.micro_batch_size)
            micro = micro // microbatches
        return cls(
            dims,
            micro_batch=micro,
            activation_checkpointing=cfg.train.activation_checkpointing,
            pp_stages_per_rank=stages_per_rank(p) if dims.pp > 1 else 1,
            **{name: getattr(p, name) for name in PARALLEL_CHOICES},
        )
