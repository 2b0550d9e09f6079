"""Typed run configuration: dataclasses loaded from TOML, the environment and ``--section.key=value``.

Precedence, lowest first: dataclass defaults, the TOML file, the env vars ``DP_SIZE TP_SIZE CP_SIZE
PP_SIZE EP_SIZE`` (``ENV_DEGREES``), CLI overrides. Everything here is checked before any process-group
work, so a bad setting fails the same way on every rank.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from meshtron.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager")
ATTENTION_KERNELS = ("auto", "flex", "varlen", "sdpa")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
ON_NONFINITE = ("error", "skip", "rollback")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")
MIXED_PRECISION = ("auto", "bf16", "fp16", "none")
DEVICES = ("auto", "cpu", "cuda")
LOGGERS = ("jsonl", "tensorboard", "wandb")
DATA_FORMATS = ("text", "chat", "preference")
OBJECTIVES = ("causal_lm", "dpo", "ipo", "simpo", "orpo", "distill")
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
"""The objectives that train on pairs of answers (``data.format=preference``)."""
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
REFERENCE_FREE_OBJECTIVES = ("simpo", "orpo")
"""Preference objectives that compare the policy with no reference model."""
REFERENCES = ("auto", "model", "lora_base", "precomputed")
TRUNCATION_MODES = ("keep_start", "keep_end")
DPO_LOSS_TYPES = ("sigmoid", "robust")
TRAIN_ON = ("assistant", "all")
WANDB_MODES = ("online", "offline", "disabled")
COMPILE = ("auto", "true", "false")
ROUTER_AUX_LOSS = ("auto", "true", "false")
ROUTER_BALANCE = ("auto", "aux_loss", "bias")
CP_METHODS = ("ring", "allgather", "ulysses", "hybrid")
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
BUILTIN_CORPUS = "builtin:python-stdlib"

# The settings that take one of a fixed set of values (a list setting: each item; an optional one: or none).
# validate_config checks them against these tuples and the settings reference (docs/configuration.md, made by
# meshtron.settings_reference) lists them, so what the page says a setting takes is what validation accepts.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "model.attn_implementation": ATTN_IMPLEMENTATIONS,
    "model.attention_kernel": ATTENTION_KERNELS,
    "data.format": DATA_FORMATS,
    "data.train_on": TRAIN_ON,
    "train.objective": OBJECTIVES,
    "preference.reference": REFERENCES,
    "preference.reference_dtype": DTYPES,
    "preference.truncation_mode": TRUNCATION_MODES,
    "dpo.loss_type": DPO_LOSS_TYPES,
    "distill.divergence": DIVERGENCES,
    "distill.teacher_dtype": DTYPES,
    "schedule.kind": LR_SCHEDULES,
    "schedule.decay_shape": DECAY_SHAPES,
    "train.activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "train.compile": COMPILE,
    "precision.mixed_precision": MIXED_PRECISION,
    "precision.float8_recipe": FLOAT8_RECIPES,
    "train.on_nonfinite": ON_NONFINITE,
    "moe.router_aux_loss": ROUTER_AUX_LOSS,
    "moe.router_balance": ROUTER_BALANCE,
    "parallel.cp_method": CP_METHODS,
    "parallel.pp_schedule": PP_SCHEDULES,
    "fsdp.reduce_dtype": DTYPES,
    "run.device": DEVICES,
    "run.loggers": LOGGERS,
    "run.wandb_mode": WANDB_MODES,
}


@dataclass
class ModelConfig:
    """The model: a local Hugging Face directory to fine-tune, or a from-scratch preset (docs/models.md)."""

    name_or_path: str | None = None
    """The model to fine-tune: a local Hugging Face model directory (config.json + safetensors), or a hub id
    (``org/name``) fetched once into the Hugging Face cache (``HF_HUB_OFFLINE=1``: from the cache only;
    docs/models.md#hub-ids). Set only one of it and preset."""
    revision: str | None = None
    """With a hub id in ``name_or_path``: its branch, tag or commit; unset: ``main``, or on a resume the commit the
    checkpoint records. The run records the commit it resolved (config.toml, checkpoints)."""
    preset: str | None = None
    """Named from-scratch architecture (docs/models.md#from-scratch-presets); unset: ``tiny`` when name_or_path is
    unset too."""
    dtype: str = "float32"
    """Storage dtype of the parameters and AdamW state (the master weights). ``float16`` is refused at start-up
    (AdamW's eps underflows in fp16 and training diverges): for fp16 compute use ``precision.mixed_precision=fp16``
    (docs/precision.md)."""
    attn_implementation: str = "auto"
    """The model's own attention where meshtron's is not in use (no document masks, cp = 1): ``sdpa``, ``eager``, or
    ``auto`` (sdpa, or eager for a family whose attention sdpa cannot compute: Gemma 2's soft-capped scores)."""
    attention_kernel: str = "auto"
    """The kernel of meshtron's document-masked attention (data.mask_documents, parallel.cp = 1): ``auto``
    (FlexAttention on CUDA, SDPA elsewhere), ``flex``, ``sdpa`` (a dense mask), or ``varlen``: CUDA, bf16 / fp16,
    torch's flash attention over the documents' cumulative lengths (layers with a sliding window, soft cap or
    sinks keep FlexAttention); **not yet run on a GPU**, check it with ``python bench/attention_kernels.py``
    (docs/attention.md#varlen-modelattention_kernelvarlen)."""
    trust_remote_code: bool = False
    """Allow a model or tokenizer directory's own Python code to run; off unless you ask."""
    max_position_embeddings: int | None = None
    """Positions the model takes (longer sequences are refused); unset: the model's own, or its own x
    ``rope_scaling``'s factor (docs/models.md#longer-context-modelrope_scaling)."""
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """Rope parameters merged into the model config's, to extend its context: ``{rope_type = "yarn", factor =
    4.0}`` (TOML) or ``--model.rope_scaling='{"rope_type": "yarn", "factor": 4.0}'``; any rope type the installed
    transformers knows (linear, yarn, llama3, longrope, dynamic, ...). Exported models carry it. Empty: the model's."""

    def validate(self) -> None:
        if self.name_or_path and self.preset:
            raise ConfigError("set only one of model.name_or_path and model.preset")
        if self.revision is not None and not self.name_or_path:
            raise ConfigError("model.revision is set without model.name_or_path; set model.name_or_path=ORG/NAME")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ConfigError(
                f"model.max_position_embeddings: must be a positive integer, got {self.max_position_embeddings}"
            )


@dataclass
class DataConfig:
    """The training data: sources, tokenizer, packing into sequences, order, cache (docs/data.md)."""

    path: str = BUILTIN_CORPUS
    """A directory made by ``meshtron data prepare``, or a text file, folder, .jsonl, .parquet, saved ``datasets``
    dir, ``datasets`` hub name, or the built-in corpus (these are prepared into data.cache_dir first). Parquet, saved
    and hub datasets need ``pip install 'meshtron[data]'``."""
    text_field: str = "text"
    """The field (column) of structured data (.jsonl, .parquet, datasets) that holds each document's text."""
    tokenizer: str = "auto"
    """``auto``: the tokenizer in ``model.name_or_path``'s folder when it has one, else the byte tokenizer; ``byte``:
    the built-in byte-level tokenizer (257 ids); or a local Hugging Face tokenizer directory, or a hub id (``org/name``,
    its ``main``)."""
    seq_len: int = 256
    """Tokens per training sequence: documents are packed into sequences of this length (docs/data.md#packing)."""
    shuffle: bool = True
    """Visit the sequences of each epoch in a random order (the same under every layout); false: in order."""
    seed: int = 0
    """Seed of the shuffled order (docs/data.md#global-batch-order)."""
    max_documents: int | None = None
    """Read at most this many documents (handy for quick runs); unset reads all."""
    cache_dir: str | None = None
    """Where tokenized, packed data is cached (each prepared corpus once, for any data.seq_len); unset:
    ``$XDG_CACHE_HOME/meshtron``, or ``~/.cache/meshtron`` when XDG_CACHE_HOME is not set (docs/data.md#cache)."""
    mask_documents: bool = True
    """Packed sequences: tokens attend only within their own document and positions restart per document
    (docs/context-parallel.md#document-masks-datamask_documents-default-on)."""
    sources: list[str] = field(default_factory=list)
    """A weighted mixture instead of ``path``: ``["/data/web:0.7", "/data/code:0.2", "/data/math:0.1"]`` (CLI
    ``--data.sources=/data/web:0.7,/data/code:0.3``; each a prepared directory or any source ``path`` takes; weights
    are normalized). See docs/data.md#mixtures-datasources."""
    format: str = "text"
    """``text`` (documents), ``chat``: conversations (lists of role/content messages) rendered with the
    tokenizer's chat template, for fine-tuning (docs/data.md#chat-fine-tuning-dataformat--chat), or ``preference``:
    pairs of answers (``prompt``, ``chosen``, ``rejected``) for the preference objectives of ``train.objective``
    (docs/post-training.md)."""
    train_on: str = "assistant"
    """With ``format=chat``: the loss on the ``assistant``'s tokens only, or on ``all`` tokens."""
    messages_field: str = "messages"
    """With ``format=chat``: the field of each row that holds its messages."""
    streaming: bool = False
    """Read ``data.path`` as a stream (a hub name, or local files too large to prepare): documents in the source's
    order, tokenized while training runs, each rank only its share; checkpoints save the position. See
    docs/data.md#streaming-datastreaming."""
    prefetch: bool = True
    """Read the next step's batches (from the memory-mapped tokens; pinned on CUDA) in a background thread while a
    step trains: the same batches either way."""
    skip_batches: list[int] = field(default_factory=list)
    """Global batches left out of the data order, numbered from 1 as a run that skips none trains them
    (step k trains batch k): e.g. ``[1200, 1201]`` after a loss spike (CLI ``--data.skip_batches=1200,1201``).
    ``train.on_nonfinite=rollback`` adds to this list by itself; checkpoints record it
    (docs/faults.md#non-finite-loss-error-skip-rollback)."""

    def validate(self) -> None:
        _positive("data.seq_len", self.seq_len)
        _positive("data.max_documents", self.max_documents, allow_none=True)
        if any(batch < 1 for batch in self.skip_batches):
            raise ConfigError(f"data.skip_batches: global batches are numbered from 1, got {self.skip_batches}")


@dataclass
class TrainConfig:
    """The optimization loop: steps, batch, seed, activation checkpointing, compile, what to do with NaN."""

    steps: int = 100
    """Optimizer steps to train."""
    global_batch_size: int = 8
    """Sequences per optimizer step, the same whatever the layout."""
    micro_batch_size: int | None = None
    """Sequences per rank per forward, fewer than global_batch_size / dp meaning gradient accumulation; unset:
    global_batch_size / dp (no accumulation). With pp > 1: sequences per pipeline microbatch, global_batch_size /
    (micro_batch_size x dp) microbatches (or set parallel.pp_microbatches)."""
    batch_rampup: str = ""
    """``START:STEPS``: the global batch starts at START sequences and grows in steps of START to global_batch_size
    over STEPS optimizer steps (Megatron's rampup-batch-size); empty: global_batch_size throughout. See
    docs/data.md#changing-the-batch-size-trainbatch_rampup-and-resuming-with-another-global-batch."""
    seed: int = 0
    """Seed of the initial weights (the same whatever the layout) and of torch's random numbers."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward to save memory: ``none``, ``full`` (recompute each decoder block) or
    ``selective`` (keep the matmul and attention outputs, recompute the rest)."""
    mlp_tiles: int = 0
    """Run each block's MLP over this many tiles of its tokens, recomputing each tile in backward, so that its
    ``tokens x intermediate_size`` activations never exist for the whole sequence; 0 or 1: off. Exact (the MLP works
    on each token alone); for long sequences (docs/long-context.md#tiled-mlp-trainmlp_tiles). Dense MLPs only."""
    activation_offload: bool = False
    """Move the tensors autograd keeps for backward (with activation checkpointing: each block's input) to host
    memory in forward, on a side stream, and bring them back ahead of their use in backward. Exact; saves GPU memory
    for host memory and PCIe traffic (docs/long-context.md#activation-offloading-trainactivation_offload)."""
    compile: str = "auto"
    """Compile each decoder block with torch.compile: ``true``, ``false``, or ``auto`` (on for CUDA, off on CPU)."""
    loss_chunk_size: int = 4096
    """Tokens per chunk of the head + cross-entropy: the full (fp32) logits are never materialized, each
    chunk is recomputed in backward. 0 computes all logits at once."""
    on_nonfinite: str = "error"
    """What to do when the loss or gradient norm is NaN/Inf: ``error`` stops, ``skip`` skips the step's update,
    ``rollback`` reloads the last checkpoint and leaves the step's global batch out from then on (needs
    checkpoint.interval); see docs/faults.md#non-finite-loss-error-skip-rollback."""
    max_rollbacks: int = 3
    """``on_nonfinite=rollback``: rollbacks in a row (no new checkpoint saved between them) before the run stops."""
    objective: str = "causal_lm"
    """What the run minimizes: ``causal_lm`` (next-token cross-entropy), or a preference objective on
    ``data.format=preference`` pairs (docs/post-training.md): ``dpo`` and ``ipo`` (against a reference model,
    ``[preference]``), ``simpo`` and ``orpo`` (reference-free); each has its own section of settings. With a
    preference objective ``global_batch_size`` counts pairs. ``distill``: the model learns from a frozen teacher
    model's next-token distributions on the data (``[distill]``, docs/post-training.md#distillation)."""

    def validate(self) -> None:
        for key in ("steps", "global_batch_size", "max_rollbacks"):
            _positive(f"train.{key}", getattr(self, key))
        _positive("train.micro_batch_size", self.micro_batch_size, allow_none=True)
        if self.loss_chunk_size < 0:
            raise ConfigError(f"train.loss_chunk_size: must be >= 0 (0 disables chunking), got {self.loss_chunk_size}")
        if self.mlp_tiles < 0:
            raise ConfigError(f"train.mlp_tiles: must be >= 0 (0 turns tiling off), got {self.mlp_tiles}")
        parse_batch_rampup(self.batch_rampup, self.global_batch_size)


@dataclass
class OptimizerConfig:
    """The optimizer (``[optimizer]``) and its own settings (``[optimizer.<name>]``, e.g. ``[optimizer.muon]``)."""

    name: str = "adamw"
    """``adamw``, or ``muon``: Muon (orthogonalized momentum) for the decoder blocks' matrices, AdamW for the
    embeddings, head, norms, biases and routers (docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of the warmup."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW's, and Muon's), on matrices and embeddings only: not on norms or biases."""
    beta1: float = 0.9
    """AdamW's beta1 (decay of the gradient's running mean)."""
    beta2: float = 0.95
    """AdamW's beta2 (decay of the squared gradient's running mean)."""
    eps: float = 1e-8
    """AdamW's epsilon (added to the denominator)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still measured)."""
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each optimizer's own settings as given, by optimizer name: TOML ``[optimizer.muon]`` ``momentum = 0.9``, CLI
    ``--optimizer.muon.momentum=0.9``; meshtron.train.optim.registry checks them (docs/optimizers.md)."""

    def validate(self) -> None:
        """The name and each optimizer's own settings are checked against meshtron.train.optim.registry by the
        preflight (the registry lives above this layer)."""
        for key in ("lr", "weight_decay", "max_grad_norm", "eps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optimizer.{key}: must be >= 0, got {getattr(self, key)}")


@dataclass
class ScheduleConfig:
    """The learning-rate schedule (``[schedule]``): warmup, then cosine, linear, constant or wsd (docs/schedules.md)."""

    kind: str = "cosine"
    """After warmup_steps of linear warmup: ``cosine`` or ``linear`` decay to min_lr over the other steps,
    ``constant`` (lr), or ``wsd`` (warmup-stable-decay: lr until the last decay_fraction of train.steps, then down
    to min_lr along decay_shape). See docs/schedules.md."""
    warmup_steps: int = 10
    """Steps of linear warmup (step k trains at lr * k / warmup_steps), then schedule.kind."""
    min_lr: float = 3e-5
    """Final learning rate of the ``cosine``, ``linear`` and ``wsd`` schedules."""
    decay_fraction: float = 0.2
    """``wsd``: the share of train.steps spent decaying (the cooldown), at the end of the run."""
    decay_shape: str = "linear"
    """``wsd``: the cooldown's shape, ``linear``, ``cosine`` or ``1-sqrt`` (1 - sqrt(progress))."""

    def validate(self) -> None:
        for key in ("min_lr", "warmup_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"schedule.{key}: must be >= 0, got {getattr(self, key)}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(
                f"schedule.decay_fraction: must be in (0, 1] (the share of train.steps that WSD spends decaying), "
                f"got {self.decay_fraction}"
            )


@dataclass
class PrecisionConfig:
    """Compute precision (``[precision]``): mixed precision, fp16 loss scaling, float8 (docs/precision.md)."""

    mixed_precision: str = "auto"
    """Compute dtype: ``bf16``, ``fp16`` (with dynamic loss scaling) or ``none`` (compute in model.dtype);
    ``auto`` is bf16 on CUDA devices that support it and none on CPU. Master weights, optimizer state
    and gradient reduction stay in model.dtype / fsdp.reduce_dtype (see docs/precision.md)."""
    fp16_initial_loss_scale: float = 65536.0
    """First loss scale of fp16's dynamic loss scaling (halved on every overflowing step, doubled after
    fp16_growth_interval steps without one)."""
    fp16_growth_interval: int = 1000
    """fp16's dynamic loss scaling: steps without an overflow before the loss scale doubles."""
    float8: bool = False
    """Float8 matmuls in the decoder blocks' linear layers (torchao; H100-class GPUs; docs/precision.md#float8)."""
    float8_recipe: str = "tensorwise"
    """With ``float8``: torchao's scaling recipe. ``tensorwise`` (one scale per tensor, fastest, float8 FSDP
    all-gather), ``rowwise`` (one scale per row, more accurate with outliers, slower, high-precision all-gathers, bf16
    compute on GPUs) or ``rowwise_with_gw_hp`` (rowwise, weight gradients in high precision); see
    docs/precision.md#recipes-precisionfloat8_recipe."""

    def validate(self) -> None:
        if self.fp16_initial_loss_scale <= 0:
            raise ConfigError(f"precision.fp16_initial_loss_scale: must be > 0, got {self.fp16_initial_loss_scale}")
        _positive("precision.fp16_growth_interval", self.fp16_growth_interval)


@dataclass
class MoeConfig:
    """Mixture-of-experts routing (``[moe]``): the load-balancing loss or bias (docs/moe.md)."""

    router_aux_loss: str = "auto"
    """Mixture-of-experts models: add the router load-balancing loss (``router_aux_loss_coef`` of the model
    config times transformers' ``load_balancing_loss_func``, over the global micro-batch): ``true``, ``false``,
    or ``auto`` (the model config's ``output_router_logits``, as transformers decides); ``true`` on a dense model
    is an error. See docs/metrics.md#mixture-of-experts."""
    router_balance: str = "auto"
    """How mixture-of-experts routers are kept balanced: ``aux_loss`` (the loss above, as ``router_aux_loss`` says)
    or ``bias`` (auxiliary-loss-free: a per-expert bias in the top-k choice, moved against each step's global load;
    meshtron.train.moe.router_balance, docs/moe.md); ``auto``: the model's own method (``bias`` for DeepSeek-V3, whose
    routers have the bias, ``aux_loss`` for the rest)."""
    router_bias_rate: float = 1e-3
    """``router_balance=bias``: how far each step moves a bias (DeepSeek-V3's update speed, 0.001)."""

    def validate(self) -> None:
        if self.router_balance == "bias" and not self.router_bias_rate > 0:
            raise ConfigError(f"moe.router_bias_rate: must be > 0, got {self.router_bias_rate}")


@dataclass(frozen=True)
class ParallelOptions:
    """How a layout runs its degrees: ``[parallel]``'s settings other than the degrees, which
    ``meshtron.distributed.mesh.ParallelDims`` describes (``ParallelConfig`` is both, as the user writes them; each
    setting's meaning is documented there). The planner's ``Layout`` holds one beside its ``ParallelDims``."""

    sequence_parallel: bool = True
    loss_parallel: bool = True
    cp_method: str = "ring"
    cp_ulysses: int = 0
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    pp_stage_layers: str | None = None


@dataclass
class ParallelConfig:
    """The layout: pp x dp_replicate x dp_shard x cp x tp must equal the number of processes; ep borrows its ranks
    from dp_shard x cp."""

    dp_replicate: int = 1
    """Data-parallel replicas: DDP, or the replicate dimension of HSDP with dp_shard > 1 (docs/data-parallel.md)."""
    dp_shard: int = -1
    """FSDP shard degree; -1 takes the ranks the other degrees leave."""
    tp: int = 1
    """Tensor-parallel degree: every linear layer, the embeddings and the head split over this many ranks
    (docs/tensor-parallel.md)."""
    sequence_parallel: bool = True
    """With tp > 1: norms and residuals work on sequence shards between blocks (less activation memory)."""
    loss_parallel: bool = True
    """With tp > 1: cross-entropy on vocab-sharded logits, never gathering the full logits."""
    cp: int = 1
    """Context-parallel degree: every sequence split over this many ranks (see docs/context-parallel.md)."""
    cp_method: str = "ring"
    """How context-parallel attention sees the other ranks' keys/values: ``ring`` or ``allgather``; or ``ulysses``:
    all-to-all from sequence shards to head shards around attention (needs heads divisible by cp); or ``hybrid``:
    Ulysses inside groups of ``cp_ulysses`` consecutive cp ranks, ring across the groups. See
    docs/context-parallel.md#methods-parallelcp_method."""
    cp_ulysses: int = 0
    """With ``cp_method=hybrid``: the Ulysses degree, the consecutive cp ranks (e.g. a node's GPUs) whose sequence
    shards an all-to-all turns into head shards before ring attention runs across their ``cp / cp_ulysses`` groups;
    it must divide cp and the heads. 0: unset (other methods). See docs/context-parallel.md#hybrid-ulysses-x-ring."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models): each MoE layer's experts split over this many ranks,
    borrowed from ``dp_shard x cp`` (the world size does not change; see docs/moe.md)."""
    pp: int = 1
    """Pipeline-parallel degree: the decoder split into stages over this many ranks (see docs/pipeline-parallel.md)."""
    pp_schedule: str = "1F1B"
    """The pipeline schedule: ``GPipe`` or ``1F1B`` (one stage per rank), ``Interleaved1F1B``,
    ``InterleavedZeroBubble`` or ``ZBVZeroBubble`` (several stages per rank); see docs/pipeline-parallel.md."""
    pp_microbatches: int | None = None
    """Microbatches each data-parallel rank's batch is split into per step; unset: parallel.pp. The other way to say
    train.micro_batch_size under pp (both given must agree)."""
    pp_stages_per_rank: int | None = None
    """Stages per pipeline rank; unset: 1 for GPipe and 1F1B, 2 for the interleaved and zero-bubble schedules."""
    pp_first_stage_layers: int | None = None
    """Decoder layers on the first stage (it also holds the embeddings); unset spreads the layers evenly."""
    pp_last_stage_layers: int | None = None
    """Decoder layers on the last stage (it also holds the final norm, head and loss)."""
    pp_stage_layers: str | None = None
    """Explicit layer count per stage, comma-separated (e.g. "3,4,4,3"); overrides the two settings above."""

    def options(self) -> ParallelOptions:
        """These settings less the degrees (``ParallelDims.from_config`` resolves those)."""
        return ParallelOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelOptions)})


@dataclass
class FSDPConfig:
    """FSDP2, the sharded data parallelism of parallel.dp_shard (docs/data-parallel.md)."""

    reshard_after_forward: bool | None = None
    """Free gathered parameters after each block's forward; unset: yes, except under pipeline parallelism,
    where every microbatch's forward would gather them again."""
    reduce_dtype: str | None = "float32"
    """Dtype gradients are reduced in; ``none`` reduces in the compute dtype (precision.mixed_precision)."""
    cpu_offload: bool = False
    """Keep parameter shards, gradients and AdamW state in host memory, copying shards to the GPU for
    compute (FSDP2's CPUOffloadPolicy; the optimizer step runs on the CPU). Needs sharded data parallelism or a
    single process, which then shards over one rank (docs/data-parallel.md)."""
    accumulate_unsharded: bool = False
    """With gradient accumulation: keep each block's full gradient between micro-batches and reduce-scatter
    once per step (less communication, full-size fp32 gradients held). False: reduce-scatter every
    micro-batch so only gradient shards are held (HSDP's all-reduce over replicas still runs once). See
    docs/data-parallel.md."""


@dataclass
class CheckpointConfig:
    """Saving and resuming (docs/checkpointing.md)."""

    dir: str | None = None
    """Where checkpoints go, one directory all ranks share (checked at start-up); unset:
    ``<run.output_dir>/checkpoints`` (docs/checkpointing.md#where-checkpoints-go-one-directory-all-ranks-share)."""
    interval: int = 0
    """Save every this many optimizer steps (and after the last); 0 saves nothing."""
    keep_last: int = 2
    """Complete checkpoints to keep (older ones are deleted after a newer one is complete); 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on."""
    resume: str = "auto"
    """``auto``: continue from ``latest`` in ``checkpoint.dir`` if there is one; a checkpoint path; or ``none``."""


@dataclass
class RunConfig:
    """The run's outputs, device, logging, profiling and hang timeout."""

    output_dir: str | None = None
    """Where config.toml and metrics.jsonl (and by default the checkpoints) go; unset: ``runs/<timestamp>`` (after a
    line naming an earlier run of the same settings there, docs/checkpointing.md#running-the-same-command-again). A
    directory holding a previous run is refused, unless the run resumes from its checkpoint. Under torchrun,
    checkpointing needs it (or checkpoint.dir) set."""
    device: str = "auto"
    """``cuda`` (one GPU per local rank, NCCL), ``cpu`` (gloo) or ``auto`` (cuda when a GPU is visible)."""
    log_every: int = 1
    """Log the metrics (metrics.jsonl, the progress line, trackers) every this many steps, and always step 1, the
    first step of each start and the last step."""
    progress: bool = True
    """Print the progress line (loss, gradient norm, learning rate, tokens/s, memory, elapsed time and an ETA)."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where rank 0 sends each logged step: ``jsonl`` (metrics.jsonl, always on) and the experiment trackers
    (meshtron.metrics.trackers) ``tensorboard`` (event files in ``<output_dir>/tensorboard``) and ``wandb``
    (Weights & Biases). See docs/metrics.md#tensorboard-and-weights--biases-runloggers."""
    wandb_project: str = "meshtron"
    """The Weights & Biases project of the ``wandb`` logger."""
    wandb_mode: str = "online"
    """``online`` (needs ``wandb login`` or WANDB_API_KEY), ``offline`` (a run folder to ``wandb sync`` later; no
    network, no key) or ``disabled``."""
    profile_steps: str = ""
    """``A-B``: record steps A to B (1-based) with the torch profiler: a Chrome trace per rank in
    ``<output_dir>/profile`` and a time summary by category in the log (docs/profiling.md). Empty: off."""
    memory_snapshot_steps: str = ""
    """``A-B``: record the CUDA allocator's history over steps A to B and write a snapshot per rank to
    ``<output_dir>/memory`` (CUDA only; one line on CPU). Empty: off."""
    collective_timeout_s: float = 600.0
    """Seconds a step (or a save) may go without every rank arriving: then every rank exits with status 124 and one
    line naming the step and the rank(s) that did not arrive (docs/faults.md#hangs). Collectives themselves time out
    60 s later; the wait for the data cache is not a collective (docs/data.md#cache)."""


@dataclass
class EvalConfig:
    """Validation (docs/evaluation.md): the loss on data the run does not train on, under every layout."""

    path: str | None = None
    """Evaluation data: any source data.path takes (prepared directories included), in data.format, read in order."""
    holdout_documents: int = 0
    """Instead of path: the last N documents (conversations with data.format=chat) of data.path, left out of
    training and evaluated on."""
    interval: int = 0
    """Evaluate every this many optimizer steps (0: only after the last step, which always evaluates when there is
    evaluation data)."""
    batches: int = 4
    """Global batches of train.global_batch_size sequences per evaluation: the first ones of the evaluation data,
    the same every time (fewer when the data holds fewer)."""

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.holdout_documents > 0


@dataclass
class LoraConfig:
    """LoRA fine-tuning (docs/lora.md): low-rank adapters beside the blocks' projections, the base weights frozen."""

    rank: int = 0
    """Rank of each adapter (0: off, every weight trains)."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (draws different masks on every data-parallel rank, like model dropout); not
    on the routed experts' adapters."""
    targets: list[str] = field(default_factory=list)
    """Names of the blocks' linear modules that get adapters (e.g. ``["q_proj", "v_proj"]``, CLI
    ``--lora.targets=q_proj,v_proj``; ``experts``: a mixture of experts' routed experts); empty: every attention and
    MLP projection, and the routed experts."""
    train_embeddings: bool = False
    """Train the token embeddings too (whole, not low-rank)."""
    train_head: bool = False
    """Train the output head too (whole, not low-rank)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class PreferenceConfig:
    """Preference data and the reference model of the preference objectives (docs/post-training.md)."""

    max_length: int | None = None
    """Tokens of each sequence (prompt + answer) at most, as TRL's ``max_length``: longer ones are cut as
    ``truncation_mode`` says; a pair whose prompt alone fills it is left out (counted). Unset:
    ``(data.seq_len + 1) // 2 - 1``, so that a pair's two sequences, each followed by a separator token, fit its row
    of ``data.seq_len + 1`` tokens (a larger one is refused)."""
    truncation_mode: str = "keep_start"
    """``keep_start``: keep the first ``max_length`` tokens of a sequence; ``keep_end``: the last (TRL's)."""
    reference: str = "auto"
    """The reference model of ``dpo`` / ``ipo``: ``model`` (a frozen copy of the starting weights, laid out and
    sharded like the policy, forward only), ``lora_base`` (with ``[lora]``: the policy with its adapters switched
    off, no second copy), ``precomputed`` (its log-probabilities computed once before training and kept with the
    run); ``auto``: ``lora_base`` with ``[lora]``, else ``model``. Reference-free objectives take none."""
    reference_dtype: str | None = None
    """Storage dtype of a ``model`` reference (e.g. ``bfloat16`` to halve its memory); unset: ``model.dtype``."""

    def validate(self) -> None:
        _positive("preference.max_length", self.max_length, allow_none=True)


@dataclass
class DpoConfig:
    """``train.objective=dpo``: Direct Preference Optimization as TRL's DPOTrainer computes it."""

    beta: float = 0.1
    """How far the policy may move from the reference (TRL's ``beta``)."""
    loss_type: str = "sigmoid"
    """``sigmoid`` (the DPO loss) or ``robust`` (robust DPO: preference labels flipped with probability
    ``label_smoothing``), as TRL's ``loss_type``."""
    label_smoothing: float = 0.0
    """With ``loss_type=robust``: the probability that a pair's preference is flipped, in [0, 0.5)."""
    rpo_alpha: float = 0.0
    """Weight of an NLL term on the chosen answers (RPO; TRL's ``loss_type=["sigmoid", "sft"]`` with
    ``loss_weights=[1, rpo_alpha]``): the mean over the global batch's chosen tokens; 0: off."""


@dataclass
class IpoConfig:
    """``train.objective=ipo``: Identity Preference Optimization (TRL's DPOTrainer ``loss_type="ipo"``, with the
    log-ratios averaged over each answer's tokens)."""

    beta: float = 0.1
    """The regularization tau of the IPO paper (TRL's ``beta``)."""


@dataclass
class SimpoConfig:
    """``train.objective=simpo``: reference-free, length-normalized (TRL's CPOTrainer ``loss_type="simpo"``)."""

    beta: float = 0.1
    """Scale of the average log-probability rewards (TRL's ``beta``)."""
    gamma: float = 0.5
    """Target reward margin (TRL's ``simpo_gamma``)."""
    cpo_alpha: float = 0.0
    """Weight of an NLL term on the chosen answers (TRL's ``cpo_alpha``, whose default is 1.0); 0: pure SimPO."""


@dataclass
class OrpoConfig:
    """``train.objective=orpo``: the chosen answers' NLL plus ``beta`` x the log odds ratio (TRL's ORPOTrainer)."""

    beta: float = 0.1
    """Weight of the odds-ratio term (TRL's ``beta``, the paper's lambda)."""


@dataclass
class DistillConfig:
    """``train.objective=distill``: the model (the student) learns a frozen teacher's next-token distributions on the
    data (text or chat), the divergences defined as TRL's GKDTrainer defines them (docs/post-training.md)."""

    teacher: str | None = None
    """The teacher: a local Hugging Face model folder or hub id (a larger model of the same tokenizer), or a
    from-scratch preset name (for tests and planning: its weights are random). Built under the run's own layout,
    frozen, forward only; not saved in checkpoints (the run's config.toml records it). It takes the student's
    ``model.trust_remote_code`` and attention settings, not ``model.rope_scaling`` / ``max_position_embeddings``
    (its own positions apply)."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the divergence's softmaxes (> 0)."""
    alpha: float = 0.0
    """Weight of the ordinary next-token cross-entropy on the data's labels, in [0, 1]; the divergence takes
    ``1 - alpha``. 0: the divergence alone (TRL's GKD loss)."""
    divergence: str = "forward_kl"
    """``forward_kl`` (KL(teacher || student), TRL's beta=0), ``reverse_kl`` (KL(student || teacher), beta=1) or
    ``jsd`` (the generalized Jensen-Shannon divergence of weight ``beta``)."""
    beta: float = 0.5
    """With ``divergence=jsd``: the teacher's weight in the mixture, in (0, 1) (TRL's ``beta``)."""
    teacher_dtype: str | None = None
    """Storage dtype of the teacher's weights (``bfloat16`` halves them while the student keeps float32 master
    weights); unset: ``bfloat16`` under bf16 mixed precision (the teacher only computes in it), else ``model.dtype``."""

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"distill.alpha: the cross-entropy's weight must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature: must be > 0, got {self.temperature}")
        if self.divergence == "jsd" and not 0.0 < self.beta < 1.0:
            raise ConfigError(
                f"distill.beta: the jsd mixture's teacher weight must be in (0, 1), got {self.beta}; "
                "use divergence=forward_kl (beta 0) or reverse_kl (beta 1) for the ends"
            )
        if self.divergence != "jsd" and self.beta != DistillConfig.beta:
            raise ConfigError(
                f"distill.beta is the weight of divergence=jsd, but distill.divergence={self.divergence}; set "
                "distill.divergence=jsd or remove distill.beta"
            )


def teacher_storage_dtype(teacher_dtype: str | None, model_dtype: str, compute_dtype: str | None) -> str:
    """The teacher's storage dtype: ``distill.teacher_dtype``; unset, bfloat16 where the run computes in bfloat16
    (the frozen teacher only ever computes in it: stored so, it needs no compute copies and half the bytes, and its
    matmuls see the same bfloat16 weights), else ``model.dtype``."""
    if teacher_dtype is not None:
        return teacher_dtype
    return "bfloat16" if compute_dtype == "bfloat16" else model_dtype


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    ipo: IpoConfig = field(default_factory=IpoConfig)
    simpo: SimpoConfig = field(default_factory=SimpoConfig)
    orpo: OrpoConfig = field(default_factory=OrpoConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


ENV_DEGREES = {"DP_SIZE": "dp_shard", "TP_SIZE": "tp", "CP_SIZE": "cp", "PP_SIZE": "pp", "EP_SIZE": "ep"}


def _sections(cfg: Config) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


@functools.cache
def field_types(section_type: type) -> dict[str, Any]:
    """A settings dataclass's fields and their types, resolved once per process (``get_type_hints`` evaluates every
    annotation string again on each call: it was ~10% of a small two-process run's CPU, once per setting)."""
    hints = typing.get_type_hints(section_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_type)}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _split_optional(tp)
    if typing.get_origin(base) is dict:
        name = "table (a JSON object on the command line)"
    elif typing.get_origin(base) is list:
        name = "list of integers" if typing.get_args(base)[0] is int else "list of strings"
    else:
        name = base.__name__
    return f"{name}{' or none' if optional else ''}"


def _typed_list(value: Any, item_type: type, from_text: bool) -> list | None:
    """``[1, 2]`` / ``["a", "b"]`` from TOML, or ``1,2`` / ``[1,2]`` / ``a,b`` from the CLI; None when the items
    are not all of ``item_type``."""
    if from_text:
        text = str(value).strip().strip("[]").strip()
        items = [item.strip().strip("'\"") for item in text.split(",") if item.strip()] if text else []
        try:
            return [item_type(item) for item in items]
        except ValueError:
            return None
    if isinstance(value, list) and all(isinstance(item, item_type) and not isinstance(item, bool) for item in value):
        return list(value)
    return None


def _coerce(key: str, value: Any, tp: Any, from_text: bool) -> Any:
    """Return ``value`` as type ``tp`` or raise a ConfigError naming ``key``."""
    base, optional = _split_optional(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}; fix the value in the config or CLI")
    if typing.get_origin(base) is dict:
        if from_text:
            try:
                value = json.loads(str(value)) if str(value).strip() else {}
            except json.JSONDecodeError:
                raise bad from None
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if typing.get_origin(base) is list:
        items = _typed_list(value, typing.get_args(base)[0], from_text)
        if items is None:
            raise bad
        return items
    if from_text:
        text = str(value).strip()
        if optional and text.lower() in ("none", "null", ""):
            return None
        if base is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise bad
        try:
            return base(text)
        except ValueError:
            raise bad from None
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))):
        return None  # TOML has no null: ``"none"`` unsets an optional setting, as on the command line
    if base is str and isinstance(value, bool):  # e.g. ``compile = true`` for a true/false/auto setting
        value = str(value).lower()
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is bool and not isinstance(value, bool):
        raise bad
    if base is int and isinstance(value, bool):
        raise bad
    if not isinstance(value, base):
        raise bad
    return value


def coerce_value(key: str, value: Any, tp: Any, *, from_text: bool) -> Any:
    """``value`` as type ``tp``, or a one-line ConfigError naming ``key`` (for settings typed elsewhere, e.g. an
    optimizer's own, meshtron.train.optim.registry)."""
    return _coerce(key, value, tp, from_text)


KEY_ALIASES = {"checkpoint.async": "checkpoint.async_save"}  # ``async`` is a Python keyword
# Keys that moved to another section (issue 45): accepted, with a one-line note naming the new key, until the next
# release, then an error. Giving an old key and its new one in the same file or command line is an error.
DEPRECATED_KEYS = {
    "train.optimizer": "optimizer.name",
    "train.lr": "optimizer.lr",
    "train.weight_decay": "optimizer.weight_decay",
    "train.beta1": "optimizer.beta1",
    "train.beta2": "optimizer.beta2",
    "train.eps": "optimizer.eps",
    "train.max_grad_norm": "optimizer.max_grad_norm",
    "train.muon_momentum": "optimizer.muon.momentum",
    "train.muon_ns_steps": "optimizer.muon.ns_steps",
    "train.lr_schedule": "schedule.kind",
    "train.warmup_steps": "schedule.warmup_steps",
    "train.min_lr": "schedule.min_lr",
    "train.decay_fraction": "schedule.decay_fraction",
    "train.decay_shape": "schedule.decay_shape",
    "train.mixed_precision": "precision.mixed_precision",
    "train.fp16_initial_loss_scale": "precision.fp16_initial_loss_scale",
    "train.fp16_growth_interval": "precision.fp16_growth_interval",
    "train.float8": "precision.float8",
    "train.float8_recipe": "precision.float8_recipe",
    "train.router_aux_loss": "moe.router_aux_loss",
    "train.router_balance": "moe.router_balance",
    "train.router_bias_rate": "moe.router_bias_rate",
}
_deprecation_noted: set[str] = set()
# Settings that were replaced: the old key -> what to use instead.
RETIRED_KEYS = {
    "fsdp.param_dtype": (
        "precision.mixed_precision (bf16 | fp16 | none), which sets FSDP's compute dtype in every layout"
    ),
}


def did_you_mean(given: str, known, prefix: str = "") -> str:
    """`` did you mean PREFIX+X?`` for X the closest of ``known`` to ``given``, or "" when none is close."""
    close = difflib.get_close_matches(given, list(known), n=1, cutoff=0.6)
    return f" did you mean {prefix}{close[0]}?" if close else ""


def all_keys(cfg: Config) -> list[str]:
    """Every ``section.key`` setting (an optimizer's own settings, ``optimizer.NAME.KEY``, are the registry's)."""
    return [
        f"{name}.{key}"
        for name, section in _sections(cfg).items()
        for key in field_types(section.__class__)
        if not (name == "optimizer" and key == "settings")
    ]


def suggest_key(cfg: Config, dotted: str) -> str:
    """The setting an unknown ``dotted`` key most likely meant, or "": the same key in another section
    (``train.seq_len``: ``data.seq_len``; a TOML key outside any table), a near miss in its own section or its
    section's near miss (``train.stepz``, ``trian.steps``: ``train.steps``), a near miss of a key found in one section
    only (``model.seqlen``: ``data.seq_len``; an old key: its new one), or the nearest of all keys."""
    keys = all_keys(cfg)
    section_name, _, key = dotted.partition(".")
    key = key or section_name
    by_name: dict[str, list[str]] = {}
    for known in [*keys, *DEPRECATED_KEYS]:
        by_name.setdefault(known.partition(".")[2], []).append(DEPRECATED_KEYS.get(known, known))
    unique = {name: found[0] for name, found in by_name.items() if len(set(found)) == 1}
    if key in unique:
        return unique[key]
    sections = list(_sections(cfg))
    near = difflib.get_close_matches(section_name, sections, n=1, cutoff=0.6)
    section_name = near[0] if near and section_name not in sections else section_name
    own = [known.partition(".")[2] for known in keys if known.startswith(f"{section_name}.")]
    close = difflib.get_close_matches(key, own, n=1, cutoff=0.7)
    if close:
        return f"{section_name}.{close[0]}"
    close = difflib.get_close_matches(key, unique, n=1, cutoff=0.8)
    if close:
        return unique[close[0]]
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.75)
    return close[0] if close else ""


def _did_you_mean_key(cfg: Config, dotted: str) -> str:
    suggestion = suggest_key(cfg, dotted)
    return f" did you mean {suggestion}?" if suggestion else ""


def _set(cfg: Config, dotted: str, value: Any, *, from_text: bool, source: str = "") -> None:
    """Set one ``section.key`` (``source``: where it was given, named in the error for an unknown key)."""
    dotted = KEY_ALIASES.get(dotted, dotted)
    if dotted in RETIRED_KEYS:
        raise ConfigError(f"{dotted} is no longer a setting; use {RETIRED_KEYS[dotted]}")
    sections = _sections(cfg)
    section_name, _, key = dotted.partition(".")
    where = f" in {source}" if source.startswith("config file") else ""
    if section_name not in sections or not key:
        raise ConfigError(
            f"unknown config key '{dotted}'{where};{_did_you_mean_key(cfg, dotted)} keys look like section.key with "
            f"section one of {', '.join(sections)}"
        )
    section = sections[section_name]
    types_ = field_types(section.__class__)
    if section_name == "optimizer" and "." in key:  # an optimizer's own setting, checked by its registry entry
        name, _, setting = key.partition(".")
        if name in types_ or not setting:
            raise ConfigError(
                f"unknown config key '{dotted}'{where}; an optimizer's own settings look like optimizer.muon.KEY"
            )
        if from_text:  # the command line's text read as TOML reads it (0.9 a float, 5 an int), else kept as text
            try:
                value = tomllib.loads(f"value = {value}")["value"]
            except tomllib.TOMLDecodeError:
                pass
        cfg.optimizer.settings.setdefault(name, {})[setting] = value
        return
    if key not in types_ or key == "settings" and section_name == "optimizer":
        valid = [name for name in types_ if not (section_name == "optimizer" and name == "settings")]
        raise ConfigError(
            f"unknown config key '{dotted}'{where};{_did_you_mean_key(cfg, dotted)} valid keys in [{section_name}]: "
            f"{', '.join(valid)}"
        )
    setattr(section, key, _coerce(dotted, value, types_[key], from_text))


def parse_overrides(extra: list[str], usage: str) -> list[str]:
    """Command-line settings as ``section.key=value`` items: ``--a.b=v`` and ``--a.b v`` are both accepted.
    ``usage``: the command's usage line, for the error about anything else."""
    result, index = [], 0
    while index < len(extra):
        item = extra[index]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            name = item.lstrip("-").split("=", 1)[0]
            suggestion = suggest_key(Config(), name) if item.startswith("--") and name else ""
            guess = f" did you mean --{suggestion}?" if suggestion else ""
            raise ConfigError(f"unexpected argument '{item}';{guess} settings look like --section.key=value ({usage})")
        if "=" not in item and index + 1 < len(extra) and not extra[index + 1].startswith("--"):
            item = f"{item}={extra[index + 1]}"
            index += 1
        result.append(item[2:])
        index += 1
    return result


def load_config(
    toml_path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Build a Config from defaults, a TOML file, the env-var degrees and ``section.key=value`` overrides."""
    cfg = Config()
    if toml_path is not None:
        path = Path(toml_path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found; pass an existing TOML file")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
        items = []
        for section_name, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"unknown config key '{section_name}' in config file '{path}';"
                    f"{_did_you_mean_key(cfg, section_name)} put settings under [section] tables"
                )
            for key, value in values.items():
                if section_name == "optimizer" and isinstance(value, dict):  # [optimizer.muon]: its own settings
                    items += [(f"optimizer.{key}.{setting}", inner) for setting, inner in value.items()]
                else:
                    items.append((f"{section_name}.{key}", value))
        _set_all(cfg, items, from_text=False, source=f"config file '{path}'")
    env = os.environ if env is None else env
    for var, key in ENV_DEGREES.items():
        if env.get(var):
            _set(cfg, f"parallel.{key}", env[var], from_text=True)
    items = []
    for item in overrides or []:
        dotted, sep, value = item.lstrip("-").partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' needs a value: write --{dotted}=VALUE")
        items.append((dotted, value))
    _set_all(cfg, items, from_text=True, source="the command line")
    resolve_config(cfg)
    validate_config(cfg)
    return cfg


def _set_all(cfg: Config, items: list[tuple[str, Any]], *, from_text: bool, source: str) -> None:
    """Set each ``(dotted key, value)`` of one source, an old key (DEPRECATED_KEYS) as its new one with a note."""
    given = {dotted for dotted, _ in items}
    for dotted, value in items:
        new = DEPRECATED_KEYS.get(dotted)
        if new is not None:
            if new in given:
                raise ConfigError(f"{dotted} and {new} are both set in {source}; {dotted} is the old name: keep {new}")
            if dotted not in _deprecation_noted:
                _deprecation_noted.add(dotted)
                # One line, saying where the key came from (no source line: lineno 0).
                warnings.warn_explicit(
                    f"{dotted} is now {new}; the old key works until the next release, then is an error",
                    FutureWarning,
                    filename=source,
                    lineno=0,
                    module=__name__,
                )
            dotted = new
        _set(cfg, dotted, value, from_text=from_text, source=source)


_BOOL_WORDS = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}")


def _check_choices(cfg: Config) -> None:
    """Each setting of ``CHOICES`` is one of its choices (each item of a list; an optional one may be unset)."""
    sections = _sections(cfg)
    for dotted, choices in CHOICES.items():
        section_name, _, key = dotted.partition(".")
        section = sections[section_name]
        value = getattr(section, key)
        if value is None and _split_optional(field_types(section.__class__)[key])[1]:
            continue
        for item in value if isinstance(value, list) else [value]:
            _choice(dotted, item, choices)


def _positive(key: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ConfigError(f"{key}: must be a positive integer, got {value}")


def resolve_config(cfg: Config) -> None:
    """The one step that changes a loaded config: spellings made canonical (``compile = 1`` -> ``"true"``, as
    ``router_aux_loss``). Run by load_config before validate_config, which only checks."""
    for section, key in ((cfg.train, "compile"), (cfg.moe, "router_aux_loss")):
        value = str(getattr(section, key)).lower()
        setattr(section, key, _BOOL_WORDS.get(value, value))


def validate_config(cfg: Config) -> None:
    """Checks that need neither the world size nor the model or data files; changes nothing (see resolve_config)."""
    _check_choices(cfg)
    for section in (
        cfg.model,
        cfg.data,
        cfg.train,
        cfg.optimizer,
        cfg.schedule,
        cfg.precision,
        cfg.moe,
        cfg.preference,
        cfg.distill,
    ):
        section.validate()
    _validate_parallel(cfg.parallel)
    _validate_run(cfg)
    _validate_eval(cfg)
    _validate_lora(cfg)
    _validate_objective(cfg)
    t = cfg.train
    if cfg.schedule.min_lr > cfg.optimizer.lr:
        raise ConfigError(
            f"schedule.min_lr ({cfg.schedule.min_lr}) is larger than optimizer.lr ({cfg.optimizer.lr}); "
            "lower schedule.min_lr"
        )
    if t.on_nonfinite == "rollback" and cfg.checkpoint.interval < 1:
        raise ConfigError("train.on_nonfinite=rollback reloads the last checkpoint: set checkpoint.interval (e.g. 100)")
    if t.batch_rampup.strip() and cfg.data.streaming:
        raise ConfigError(
            "train.batch_rampup needs indexed data: a stream's lanes are one per sequence of the global batch; "
            "set data.streaming=false (prepare the data) or leave train.batch_rampup empty"
        )


def _validate_parallel(p) -> None:
    _positive("parallel.pp_microbatches", p.pp_microbatches, allow_none=True)
    _positive("parallel.pp_stages_per_rank", p.pp_stages_per_rank, allow_none=True)
    for key in ("dp_replicate", "tp", "cp", "pp"):
        _positive(f"parallel.{key}", getattr(p, key))
    if p.dp_shard != -1:
        _positive("parallel.dp_shard", p.dp_shard)
    if p.cp_method == "hybrid":
        if p.cp_ulysses < 0 or (p.cp > 1 and p.cp_ulysses == 0):  # unset with cp = 1: no cp_method matters yet
            raise ConfigError(
                f"parallel.cp_method=hybrid needs parallel.cp_ulysses (the Ulysses degree inside each group of "
                f"consecutive cp ranks), got {p.cp_ulysses}; set it to a divisor of parallel.cp={p.cp}, e.g. the GPUs "
                "per node"
            )
        if p.cp_ulysses and p.cp % p.cp_ulysses:
            raise ConfigError(
                f"parallel.cp_ulysses={p.cp_ulysses} does not divide parallel.cp={p.cp} (the cp ranks form groups of "
                "cp_ulysses); use a divisor of parallel.cp"
            )
    elif p.cp_ulysses:
        raise ConfigError(
            f"parallel.cp_ulysses={p.cp_ulysses} is only used by parallel.cp_method=hybrid, not {p.cp_method}; set "
            "parallel.cp_method=hybrid or leave parallel.cp_ulysses unset (0)"
        )


def _validate_run(cfg: Config) -> None:
    """``[run]`` and ``[checkpoint]``."""
    _positive("run.log_every", cfg.run.log_every)
    if not cfg.run.collective_timeout_s > 0:
        raise ConfigError(f"run.collective_timeout_s: must be > 0 seconds, got {cfg.run.collective_timeout_s}")
    for key in ("interval", "keep_last"):
        if getattr(cfg.checkpoint, key) < 0:
            raise ConfigError(f"checkpoint.{key}: must be >= 0, got {getattr(cfg.checkpoint, key)}")
    for key in ("profile_steps", "memory_snapshot_steps"):
        steps = parse_step_range(f"run.{key}", getattr(cfg.run, key))
        if steps is not None and steps[1] > cfg.train.steps:
            raise ConfigError(
                f"run.{key}={getattr(cfg.run, key)} goes past the last step (train.steps={cfg.train.steps}); "
                f"profile steps up to {cfg.train.steps}"
            )


def parse_step_range(setting: str, value: str) -> tuple[int, int] | None:
    """``"A-B"`` (or ``"A"``) -> (A, B), 1-based and inclusive; ``""`` -> None. ``setting`` names it in the error."""
    text = value.strip()
    if not text:
        return None
    match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
    first, last = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not 1 <= first <= last:
        raise ConfigError(f"{setting}: '{value}' is not a range of steps; write A-B with 1 <= A <= B (e.g. 5-7)")
    return first, last


def parse_batch_rampup(value: str, global_batch_size: int) -> tuple[int, int] | None:
    """``train.batch_rampup`` ``"START:STEPS"`` -> (START, STEPS); ``""`` -> None."""
    text = value.strip()
    if not text:
        return None
    match = re.fullmatch(r"(\d+)\s*:\s*(\d+)", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ConfigError(
            f"train.batch_rampup: '{value}' is not START:STEPS; write e.g. 64:1000 (64 sequences at first, "
            "growing to train.global_batch_size over 1000 steps)"
        )
    start, steps = int(match.group(1)), int(match.group(2))
    if global_batch_size % start or start >= global_batch_size:
        raise ConfigError(
            f"train.batch_rampup: START {start} must be smaller than train.global_batch_size {global_batch_size} "
            "and divide it (the batch grows in steps of START)"
        )
    return start, steps


def _validate_lora(cfg: Config) -> None:
    lora = cfg.lora
    if lora.rank < 0:
        raise ConfigError(f"lora.rank: must be >= 0 (0 turns LoRA off), got {lora.rank}")
    if not lora.enabled:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"lora.alpha: must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout: must be in [0, 1), got {lora.dropout}")
    if cfg.precision.float8:
        raise ConfigError("lora.rank > 0 with precision.float8 is not supported yet; set precision.float8=false")
    if cfg.optimizer.name != "adamw":
        raise ConfigError(
            f"lora.rank > 0 with optimizer.name={cfg.optimizer.name} is not supported yet; set optimizer.name=adamw"
        )


OBJECTIVE_SECTIONS = {
    "dpo": DpoConfig,
    "ipo": IpoConfig,
    "simpo": SimpoConfig,
    "orpo": OrpoConfig,
    "distill": DistillConfig,
}
"""Each objective's own section of settings."""


def uses_reference(cfg: Config) -> bool:
    """Whether the run's objective compares the policy with a reference model."""
    return cfg.train.objective in ("dpo", "ipo")


def reference_kind(cfg: Config) -> str:
    """``preference.reference`` resolved: ``model``, ``lora_base`` or ``precomputed`` (``none`` without one)."""
    if not uses_reference(cfg):
        return "none"
    if cfg.preference.reference == "auto":
        return "lora_base" if cfg.lora.enabled else "model"
    return cfg.preference.reference


def _validate_objective(cfg: Config) -> None:
    """``train.objective``, ``data.format``, ``[preference]`` and the objectives' sections agree."""
    objective, preference = cfg.train.objective, cfg.preference
    for name, section_type in OBJECTIVE_SECTIONS.items():
        changed = [
            f.name
            for f in dataclasses.fields(section_type)
            if getattr(getattr(cfg, name), f.name) != getattr(section_type(), f.name)
        ]
        if changed and objective != name:
            raise ConfigError(
                f"{name}.{changed[0]} is a setting of train.objective={name}, but train.objective={objective}; set "
                f"train.objective={name} or remove the [{name}] settings"
            )
    if objective not in PREFERENCE_OBJECTIVES:
        if cfg.data.format == "preference":
            raise ConfigError(
                "data.format=preference holds pairs of answers for a preference objective, not for "
                f"train.objective={objective}; set train.objective=dpo (or ipo, simpo, orpo), or use data.format=chat"
            )
        changed = [
            f.name
            for f in dataclasses.fields(PreferenceConfig)
            if getattr(preference, f.name) != getattr(PreferenceConfig(), f.name)
        ]
        if changed:
            raise ConfigError(
                f"preference.{changed[0]} is a setting of the preference objectives, but train.objective={objective}; "
                "set train.objective=dpo (or ipo, simpo, orpo) or remove the [preference] settings"
            )
        if objective == "distill" and not cfg.distill.teacher:
            raise ConfigError(
                "train.objective=distill needs its teacher: set distill.teacher=FOLDER (a Hugging Face model folder "
                "with the student's tokenizer)"
            )
        return
    if cfg.data.format != "preference":
        raise ConfigError(
            f"train.objective={objective} trains on pairs of answers: set data.format=preference (rows with prompt, "
            "chosen and rejected; docs/post-training.md#data)"
        )
    if objective in REFERENCE_FREE_OBJECTIVES and preference.reference != "auto":
        raise ConfigError(
            f"train.objective={objective} is reference-free, but preference.reference={preference.reference}; "
            "remove preference.reference (or use train.objective=dpo or ipo)"
        )
    if objective in REFERENCE_FREE_OBJECTIVES and preference.reference_dtype is not None:
        raise ConfigError(f"train.objective={objective} is reference-free: remove preference.reference_dtype")
    if preference.reference == "lora_base" and not cfg.lora.enabled:
        raise ConfigError(
            "preference.reference=lora_base is the policy with its LoRA adapters off: set lora.rank > 0, or use "
            "preference.reference=model"
        )
    if preference.reference_dtype is not None and reference_kind(cfg) != "model":
        raise ConfigError(
            f"preference.reference_dtype is the storage dtype of a preference.reference=model copy, but the "
            f"reference is {reference_kind(cfg)}; remove preference.reference_dtype"
        )
    dpo = cfg.dpo
    if dpo.label_smoothing and dpo.loss_type != "robust":
        raise ConfigError(
            f"dpo.label_smoothing={dpo.label_smoothing} is used by dpo.loss_type=robust only (TRL's), not "
            f"{dpo.loss_type}; set dpo.loss_type=robust or remove dpo.label_smoothing"
        )
    if not 0 <= dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing: must be in [0, 0.5), got {dpo.label_smoothing}")
    for key in ("dpo.beta", "ipo.beta", "simpo.beta", "orpo.beta"):
        section, name = key.split(".")
        if not getattr(getattr(cfg, section), name) > 0:
            raise ConfigError(f"{key}: must be > 0, got {getattr(getattr(cfg, section), name)}")
    for key in ("dpo.rpo_alpha", "simpo.cpo_alpha"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(f"{key}: must be >= 0 (0 turns the NLL term off)")


def _validate_eval(cfg: Config) -> None:
    e, d = cfg.eval, cfg.data
    for key in ("holdout_documents", "interval"):
        if getattr(e, key) < 0:
            raise ConfigError(f"eval.{key}: must be >= 0 (0 turns it off), got {getattr(e, key)}")
    _positive("eval.batches", e.batches)
    if e.path and e.holdout_documents:
        raise ConfigError("set only one of eval.path and eval.holdout_documents (the evaluation data)")
    if e.interval and not e.enabled:
        raise ConfigError(f"eval.interval={e.interval} needs evaluation data: set eval.path or eval.holdout_documents")
    if e.holdout_documents and (d.sources or d.streaming):
        what = "data.sources (a mixture)" if d.sources else "data.streaming"
        raise ConfigError(
            f"eval.holdout_documents holds out documents of one data.path, not of {what}; set eval.path instead"
        )


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as nested dicts. TOML has no null: an unset (None) value is left out where unset is the default,
    else written ``"none"`` (e.g. ``fsdp.reduce_dtype``), which loads back as unset."""
    result: dict[str, dict[str, Any]] = {}
    for name, section in _sections(cfg).items():
        unset_default = {f.name for f in dataclasses.fields(section) if f.default is None}
        values = dataclasses.asdict(section).items()
        result[name] = {k: "none" if v is None else v for k, v in values if v is not None or k not in unset_default}
    if not cfg.model.rope_scaling:  # an empty table, the default: left out
        del result["model"]["rope_scaling"]
    result["optimizer"].update(result["optimizer"].pop("settings"))  # [optimizer.muon] tables
    return result


def to_toml(cfg: Config) -> str:
    return tomli_w.dumps(to_dict(cfg))


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(to_toml(cfg))
