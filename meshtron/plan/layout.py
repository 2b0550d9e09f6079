"""What the planner varies (a Layout) and what it keeps fixed (a Workload), and their link to a meshtron Config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from meshtron.config import (
    OBJECTIVES,
    PREFERENCE_OBJECTIVES,
    REFERENCE_FREE_OBJECTIVES,
    Config,
    ParallelConfig,
    ParallelOptions,
    reference_kind,
    teacher_storage_dtype,
)
from meshtron.distributed.mesh import ParallelDims
from meshtron.errors import ConfigError

if TYPE_CHECKING:
    from meshtron.plan.teacher import Teacher

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

REFERENCE_KINDS = ("none", "model", "lora_base", "precomputed")
"""A Workload's ``reference``: ``preference.reference`` resolved (meshtron.config.reference_kind)."""

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
    """``train.mlp_tiles``: each dense MLP keeps only its input for backward
    (meshtron.distributed.activation_memory.tiled_mlp)."""
    activation_offload: bool = False
    """``train.activation_offload``: what autograd keeps for backward lives in host memory between the forward and
    the backward (meshtron.distributed.activation_memory.offload)."""
    cpu_offload: bool = False
    """``fsdp.cpu_offload``: parameters, gradients and optimizer state in host memory (FSDP, over one rank in a
    world of one); layouts without FSDP are refused with it, as preflight does."""
    objective: str = "causal_lm"
    """``train.objective``: ``causal_lm``, or a preference objective (``dpo``, ``ipo``, ``simpo``, ``orpo``), whose
    rows each hold one pair (two sequences in ``seq_len + 1`` tokens) and whose head computes per-token
    log-probabilities (meshtron.train.loss.token_logps) instead of the fused cross-entropy, or ``distill`` (a frozen
    ``teacher``'s forward per micro-batch, a fused chunked divergence on both heads)."""
    reference: str = "none"
    """The reference model of ``dpo`` / ``ipo`` (``preference.reference`` resolved, meshtron.config.reference_kind):
    ``model`` (a frozen copy laid out like the policy: its parameters and a forward per micro-batch), ``lora_base``
    (the policy with its adapters off: a forward, no bytes), ``precomputed`` (nothing); ``none`` for the others."""
    reference_dtype: str | None = None
    """``preference.reference_dtype``: a ``model`` reference's storage dtype; None: ``model_dtype``."""
    teacher: Teacher | None = None
    """``distill.teacher`` resolved (meshtron.plan.teacher): the teacher of ``distill``, None for the others."""
    teacher_dtype: str | None = None
    """``distill.teacher_dtype``: the teacher's storage dtype; None: as a run resolves it (teacher_storage_dtype)."""
    divergence: str = "forward_kl"
    """``distill.divergence``: what the unfused divergence keeps for backward depends on it."""

    def __post_init__(self):
        if self.compute_dtype != self.model_dtype and self.compute_dtype not in MIXED_PRECISION_DTYPES.values():
            raise ConfigError(
                f"compute dtype {self.compute_dtype} with model dtype {self.model_dtype}: "
                f"mixed precision computes in {' or '.join(MIXED_PRECISION_DTYPES.values())}"
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective {self.objective}: one of {', '.join(OBJECTIVES)}")
        takes_reference = self.preference and self.objective not in REFERENCE_FREE_OBJECTIVES
        if takes_reference != (self.reference != "none") or self.reference not in REFERENCE_KINDS:
            wanted = ", ".join(REFERENCE_KINDS[1:]) if takes_reference else "none"
            raise ConfigError(f"objective {self.objective} takes reference {wanted}, not {self.reference}")
        if self.distill != (self.teacher is not None):
            wanted = "a teacher" if self.distill else "no teacher"
            raise ConfigError(f"objective {self.objective} takes {wanted} (distill.teacher)")
        if self.teacher_dtype is not None and not self.distill:
            raise ConfigError(f"objective {self.objective} has no teacher to store in {self.teacher_dtype}")

    @property
    def preference(self) -> bool:
        """Whether the objective is a preference objective (pairs, per-token log-probabilities on the head)."""
        return self.objective in PREFERENCE_OBJECTIVES

    @property
    def distill(self) -> bool:
        """Whether the objective is ``distill``: a frozen teacher's forward per micro-batch, a divergence on the
        heads."""
        return self.objective == "distill"

    @property
    def teacher_storage_dtype(self) -> str:
        """The teacher's storage dtype as a run resolves it (meshtron.config.teacher_storage_dtype)."""
        mixed = self.compute_dtype if self.compute_dtype != self.model_dtype else None
        return teacher_storage_dtype(self.teacher_dtype, self.model_dtype, mixed)

    @property
    def teacher_bytes_per_param(self) -> int:
        """Bytes of a parameter of the teacher (``teacher_storage_dtype``)."""
        return DTYPE_BYTES[self.teacher_storage_dtype]

    @property
    def teacher_compute_dtype(self) -> str:
        """The dtype the teacher computes in, and its final hidden states have: the compute dtype under mixed
        precision, else the teacher's own storage dtype."""
        if self.compute_dtype != self.model_dtype:
            return self.compute_dtype
        return self.teacher_storage_dtype

    @property
    def live_reference(self) -> bool:
        """Whether each micro-batch runs a reference forward first (``model`` or ``lora_base``)."""
        return self.reference in ("model", "lora_base")

    @property
    def reference_bytes_per_param(self) -> int:
        """Bytes of a parameter of a ``model`` reference (``reference_dtype``, else the model's dtype)."""
        return DTYPE_BYTES[self.reference_dtype or self.model_dtype]

    @property
    def mixed_precision(self) -> str:
        """The ``precision.mixed_precision`` value that runs this workload."""
        if self.compute_dtype == self.model_dtype:
            return "none"
        return next(name for name, dtype in MIXED_PRECISION_DTYPES.items() if dtype == self.compute_dtype)

    @classmethod
    def from_config(cls, cfg: Config, device: str = "cuda") -> "Workload":
        """The workload of ``cfg`` run on ``device`` (``cpu`` to compare with the test suite's CPU runs)."""
        fields = {s.field_name: s.to_field(s.read(cfg), cfg, device) for s in WORKLOAD_SETTINGS}
        return cls(device=device, **fields)

    def write_to(self, cfg: Config) -> None:
        """Set ``cfg``'s settings that this workload holds (``WORKLOAD_SETTINGS``), as a run of it needs them."""
        for setting in WORKLOAD_SETTINGS:
            setting.write(cfg, setting.to_setting(getattr(self, setting.field_name), self))


def _same(value: Any, *_) -> Any:
    return value


def _compute_dtype(_mixed_precision: str, cfg: Config, device: str) -> str:
    return config_compute_dtype(cfg, device)


def _mixed_precision(_compute_dtype: str, workload: Workload) -> str:
    return workload.mixed_precision


def _compiled(setting: str, _cfg: Config, device: str) -> bool:
    from meshtron.distributed.parallelize import compile_enabled

    return compile_enabled(setting, device)


def _compile_setting(compiled: bool, _workload: Workload) -> str:
    return "auto" if compiled else "false"


def _reference_kind(_setting: str, cfg: Config, _device: str) -> str:
    return reference_kind(cfg)


def _reference_setting(kind: str, _workload: Workload) -> str:
    return "auto" if kind == "none" else kind


def _preference_data(objective: str) -> dict[str, Any]:
    """The settings a run of ``objective`` needs besides it: preference objectives train on pairs."""
    return {"data.format": "preference"} if objective in PREFERENCE_OBJECTIVES else {}


def _teacher(_name: str | None, cfg: Config, _device: str) -> Teacher | None:
    # Here, not at the top: building the teacher's shape imports torch and transformers.
    from meshtron.plan.teacher import config_teacher

    return config_teacher(cfg)


def _teacher_name(teacher: Teacher | None, _workload: Workload) -> str | None:
    return teacher.name if teacher is not None else None


def _optimizer_settings(_given: dict, cfg: Config, _device: str) -> Any:
    # Here, not at the top: the registry imports torch, which `meshtron --help` and `meshtron data` never need.
    from meshtron.train.optim.registry import optimizer_settings

    return optimizer_settings(cfg.optimizer)


def _given_settings(settings: Any, workload: Workload) -> dict[str, dict[str, Any]]:
    """``[optimizer.<name>]`` as a user would write it: the settings that differ from their defaults."""
    if settings is None:
        return {}
    default = type(settings)()
    changed = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    changed = {name: value for name, value in changed.items() if value != getattr(default, name)}
    return {workload.optimizer: changed} if changed else {}


@dataclass(frozen=True)
class WorkloadSetting:
    """A config setting a Workload holds: its key (``section.name``), the Workload field, and the conversion each
    way (as is, unless the field is a resolved form of the setting)."""

    key: str
    field_name: str
    to_field: Callable[[Any, Config, str], Any] = _same
    """(the setting's value, the whole config, the device) -> the field's value."""
    to_setting: Callable[[Any, Workload], Any] = _same
    """(the field's value, the workload) -> the setting's value."""
    implies: Callable[[Any], dict[str, Any]] = lambda _value: {}
    """(the setting's value) -> other settings (``section.name``: value) a run of it needs, written with it."""

    def read(self, cfg: Config) -> Any:
        section, name = self.key.split(".")
        return getattr(getattr(cfg, section), name)

    def write(self, cfg: Config, value: Any) -> None:
        for key, setting in {self.key: value, **self.implies(value)}.items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, setting)


WORKLOAD_SETTINGS = (
    WorkloadSetting("data.seq_len", "seq_len"),
    WorkloadSetting("train.global_batch_size", "global_batch"),
    WorkloadSetting("model.dtype", "model_dtype"),
    WorkloadSetting("precision.mixed_precision", "compute_dtype", _compute_dtype, _mixed_precision),
    WorkloadSetting("data.mask_documents", "mask_documents"),
    WorkloadSetting("train.loss_chunk_size", "loss_chunk_size"),
    WorkloadSetting("fsdp.accumulate_unsharded", "accumulate_unsharded"),
    WorkloadSetting("train.compile", "compiled", _compiled, _compile_setting),
    WorkloadSetting("model.attn_implementation", "attn_implementation"),
    WorkloadSetting("optimizer.name", "optimizer"),
    WorkloadSetting("optimizer.settings", "optimizer_settings", _optimizer_settings, _given_settings),
    WorkloadSetting("precision.float8", "float8"),
    WorkloadSetting("precision.float8_recipe", "float8_recipe"),
    WorkloadSetting("train.mlp_tiles", "mlp_tiles"),
    WorkloadSetting("train.activation_offload", "activation_offload"),
    WorkloadSetting("fsdp.cpu_offload", "cpu_offload"),
    WorkloadSetting("train.objective", "objective", implies=_preference_data),
    WorkloadSetting("preference.reference", "reference", _reference_kind, _reference_setting),
    WorkloadSetting("preference.reference_dtype", "reference_dtype"),
    WorkloadSetting("distill.teacher", "teacher", _teacher, _teacher_name),
    WorkloadSetting("distill.teacher_dtype", "teacher_dtype"),
    WorkloadSetting("distill.divergence", "divergence"),
)
"""The one map between a Config and a Workload, read by ``Workload.from_config`` and written by
``Workload.write_to``: every Workload field but ``device`` (where the run is planned, not a setting)."""


@dataclass(frozen=True)
class Layout:
    """One way to run a workload: the degrees (``dims``), how they run (``parallel``), the per-forward batch and
    activation checkpointing."""

    dims: ParallelDims = ParallelDims()
    """The degrees, as meshtron resolves them; ``dims.ep`` is the expert-parallel degree (``parallel.ep``, mixtures
    of experts only): ranks borrowed from ``dp_shard x cp``, each holding ``E / ep`` experts and receiving the
    tokens routed to them (meshtron.distributed.expert_parallel). Not a mesh dimension: the world size does not
    change."""
    micro_batch: int = 1
    """Sequences per forward on each data-parallel rank (a pipeline microbatch under pp > 1)."""
    activation_checkpointing: str = "none"
    parallel: ParallelOptions = ParallelOptions()
    """The ``[parallel]`` settings besides the degrees. ``pp_stages_per_rank`` None: one stage per rank;
    ``pp_microbatches`` stays None (``micro_batch`` and the workload say it)."""

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pipeline rank holds."""
        return self.parallel.pp_stages_per_rank or 1

    @property
    def fsdp_size(self) -> int:
        """Ranks each parameter is sharded over (dp_shard x cp); 1 means whole parameters."""
        return self.dims.dp_shard * self.dims.cp

    @property
    def efsdp_size(self) -> int:
        """Ranks each expert parameter is sharded over under expert parallelism: ``dp_shard x cp / ep``
        (the ``efsdp`` mesh; ``fsdp_size`` without EP)."""
        return max(1, self.fsdp_size // self.dims.ep)

    def local_batch(self, workload: Workload) -> int:
        return workload.global_batch // self.dims.dp

    def microbatches(self, workload: Workload) -> int:
        """Forwards per optimizer step on one rank: accumulation steps, or pipeline microbatches."""
        return self.local_batch(workload) // self.micro_batch

    def parallel_config(self, workload: Workload | None = None) -> ParallelConfig:
        """The ``[parallel]`` section that runs this layout (``pp_microbatches`` only given ``workload``)."""
        pipelined = self.dims.pp > 1
        options = dataclasses.replace(
            self.parallel,
            pp_stages_per_rank=self.stages_per_rank if pipelined else None,
            pp_microbatches=self.microbatches(workload) if workload is not None and pipelined else None,
        )
        return self.dims.to_config(options)

    def check(self, hf_config, workload: Workload) -> None:
        """Raise ConfigError where ``meshtron train``'s preflight would refuse this layout for ``hf_config`` and
        ``workload``: the degrees (``ParallelDims.from_config``: their product, ``ep`` dividing ``dp_shard x cp``)
        and ``check_layout``, the checks preflight runs (family, experts, context, attention, pipeline, tensor), on
        the model and on a distillation teacher under its own even pipeline split (refused naming distill.teacher)."""
        from meshtron.config import FSDPConfig
        from meshtron.distributed.data_parallel import check_data_parallel
        from meshtron.distributed.layout_checks import check_layout

        parallel = self.parallel_config(workload)
        check_data_parallel(FSDPConfig(cpu_offload=workload.cpu_offload), self.dims)
        dims = ParallelDims.from_config(parallel, self.dims.world_size)
        models = [("", hf_config, parallel)]
        if workload.teacher is not None:  # as preflight checks the teacher: its own even pipeline split
            models.append(
                ("distill.teacher: ", workload.teacher.hf_config, self.teacher_layout().parallel_config(workload))
            )
        for prefix, config, model_parallel in models:
            try:
                check_layout(
                    config,
                    model_parallel,
                    dims,
                    seq_len=workload.seq_len,
                    mask_documents=workload.mask_documents,
                    attn_implementation=workload.attn_implementation,
                    local_batch=self.local_batch(workload),
                    micro_batch_size=None,  # the planner's micro_batch is the pipeline microbatch (pp_microbatches)
                    device_type=workload.device,
                )
            except ConfigError as err:
                raise ConfigError(f"{prefix}{err}") from None

    def teacher_layout(self) -> "Layout":
        """The layout a distillation teacher runs under: these degrees and options, but its own layers split evenly
        over the same pipeline stages (no ``pp_first_stage_layers``, ``pp_last_stage_layers`` or
        ``pp_stage_layers``)."""
        even = dataclasses.replace(
            self.parallel, pp_first_stage_layers=None, pp_last_stage_layers=None, pp_stage_layers=None
        )
        return dataclasses.replace(self, parallel=even)

    def write_to(self, cfg: Config) -> None:
        """Set ``cfg``'s ``[parallel]``, ``train.micro_batch_size`` and ``train.activation_checkpointing`` to run this
        layout (no ``parallel.pp_microbatches``: ``train.micro_batch_size`` says it)."""
        cfg.parallel = self.parallel_config()
        cfg.train.micro_batch_size = self.micro_batch
        cfg.train.activation_checkpointing = self.activation_checkpointing

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, hf_config) -> "Layout":
        """The layout a meshtron run of ``cfg`` on ``world_size`` processes uses (degrees and batch resolved)."""
        from meshtron.distributed.pipeline_parallel import check_pipeline, stages_per_rank
        from meshtron.train.setup.preflight import micro_batch_split

        dims = ParallelDims.from_config(cfg.parallel, world_size)
        micro, _ = micro_batch_split(cfg, dims)
        per_rank = 1
        if dims.pp > 1:
            microbatches = check_pipeline(cfg.parallel, hf_config, micro, cfg.train.micro_batch_size)
            micro = micro // microbatches
            per_rank = stages_per_rank(cfg.parallel)
        options = dataclasses.replace(
            cfg.parallel.options(), pp_microbatches=None, pp_stages_per_rank=per_rank if per_rank > 1 else None
        )
        return cls(dims, micro, cfg.train.activation_checkpointing, options)
