"""``meshtron plan`` and ``meshtron train --dry-run``: argument handling and printing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

from meshtron.config import (
    ATTN_IMPLEMENTATIONS,
    FLOAT8_RECIPES,
    OBJECTIVES,
    PREFERENCE_OBJECTIVES,
    REFERENCE_FREE_OBJECTIVES,
    REFERENCES,
    Config,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from meshtron.errors import ConfigError
from meshtron.plan.hardware import GPUS, Hardware, hardware, parse_gigabytes
from meshtron.plan.layout import MIXED_PRECISION_DTYPES

HARDWARE_OVERRIDES = tuple(f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "memory_gb"))
PLAN_USAGE = "meshtron plan --model PRESET|DIR|CONFIG.json --gpus N [--seq-len L] [--global-batch B] [options]"
DEFAULT_SEQ_LEN = 4096
"""``--seq-len`` when not given (capped at the model's ``max_position_embeddings``)."""
DEFAULT_BATCH_TOKENS = 2**20
"""``--global-batch`` when not given: about this many tokens per step (see default_global_batch)."""


def default_seq_len(hf_config) -> int:
    """4096 tokens, or the model's ``max_position_embeddings`` when it is shorter."""
    return min(DEFAULT_SEQ_LEN, getattr(hf_config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN)


def default_global_batch(seq_len: int, gpus: int) -> int:
    """About DEFAULT_BATCH_TOKENS (2**20) tokens per step in whole sequences, rounded to a multiple of ``gpus`` so
    that every data-parallel degree divides it; at least one sequence per GPU."""
    return max(1, round(DEFAULT_BATCH_TOKENS / seq_len / gpus)) * gpus


def add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="rank the layouts that fit a model on a cluster", usage=PLAN_USAGE)
    plan.add_argument(
        "--model", required=True, help="a meshtron preset, a local Hugging Face model directory or a config.json"
    )
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    plan.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's max_position_embeddings when shorter)",
    )
    plan.add_argument(
        "--max-position-embeddings",
        type=int,
        help="positions the model takes, as model.max_position_embeddings (default: the model's, or its own x "
        "--rope-scaling's factor)",
    )
    plan.add_argument(
        "--rope-scaling",
        metavar="JSON",
        help='rope parameters that extend the model\'s context, as model.rope_scaling: e.g. \'{"rope_type": "yarn", '
        '"factor": 4}\' (docs/models.md#longer-context-modelrope_scaling)',
    )
    plan.add_argument(
        "--mlp-tiles",
        type=int,
        default=0,
        help="plan train.mlp_tiles=N: each block's MLP keeps only its input for backward (docs/long-context.md)",
    )
    plan.add_argument(
        "--activation-offload",
        action="store_true",
        help="plan train.activation_offload=true: what autograd keeps for backward waits in host memory "
        "(--host-memory-gb per GPU, copies at --pcie-gbps; docs/long-context.md)",
    )
    plan.add_argument(
        "--cpu-offload",
        action="store_true",
        help="plan fsdp.cpu_offload=true: parameters, gradients and optimizer state in host memory, the optimizer "
        "step on the CPU (layouts without FSDP are left out, except a single GPU)",
    )
    plan.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest sequence the model trains at on --gpus (with activation offloading, tiled MLPs and "
        "the model state in host memory where they help) and print the settings it needs; --global-batch defaults "
        "to 1",
    )
    plan.add_argument(
        "--global-batch",
        type=int,
        help="sequences per optimizer step (default: about 2^20 = 1M tokens per step, a usual pretraining batch "
        "for 1B-8B models, in whole sequences rounded to a multiple of --gpus so that every data-parallel degree "
        "divides it; at least one sequence per GPU)",
    )
    plan.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(GPUS)} (default h100)")
    plan.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB (default: the GPU's)")
    for name in HARDWARE_OVERRIDES:  # every other constant of meshtron.plan.hardware.Hardware
        kind = int if name == "gpus_per_node" else float
        plan.add_argument(
            f"--{name.replace('_', '-')}", type=kind, help=f"override Hardware.{name} (see docs/planning.md)"
        )
    plan.add_argument("--no-mask-documents", action="store_true", help="plan for data.mask_documents=false")
    plan.add_argument(
        "--attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        help="model.attn_implementation (default sdpa; eager for a family that cannot use sdpa, as Gemma 2)",
    )
    plan.add_argument(
        "--mixed-precision",
        choices=tuple(MIXED_PRECISION_DTYPES) + ("none",),
        default="bf16",
        help="precision.mixed_precision: compute dtype of every layout (default bf16; none: fp32 compute)",
    )
    plan.add_argument(
        "--model-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model.dtype: the stored weights' dtype (default float32 master weights; bfloat16 trains in bf16 alone, "
        "e.g. a LoRA run whose frozen base then takes half the memory)",
    )
    plan.add_argument(
        "--loss-chunk-size",
        type=int,
        default=TrainConfig.loss_chunk_size,
        help=f"train.loss_chunk_size: tokens per loss chunk, 0 for none (default {TrainConfig.loss_chunk_size})",
    )
    plan.add_argument(
        "--no-compile",
        action="store_true",
        help="plan for train.compile=false (eager blocks; default: compiled, as auto does on GPUs)",
    )
    plan.add_argument(
        "--float8",
        action="store_true",
        help="plan for precision.float8=true (the blocks' linears in float8; H100-class GPUs)",
    )
    plan.add_argument(
        "--float8-recipe",
        choices=FLOAT8_RECIPES,
        default="tensorwise",
        help="precision.float8_recipe with --float8 (rowwise: measured no faster than bf16 on an H200)",
    )
    plan.add_argument(
        "--accumulate-unsharded",
        action="store_true",
        help="fsdp.accumulate_unsharded: hold full gradients between accumulated micro-batches, "
        "one reduce-scatter per step (default: a reduce-scatter per micro-batch)",
    )
    plan.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="plan a LoRA run (lora.rank, adapters on every projection): the base frozen (no gradients or AdamW "
        "state), its weight gradients skipped (default 0: full training)",
    )
    plan.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="causal_lm",
        help="train.objective: causal_lm (default), or a preference objective on pairs (one pair a row of --seq-len "
        "tokens; --global-batch counts pairs): dpo / ipo with a reference model (--reference), simpo / orpo without "
        "(docs/post-training.md); or distill from a frozen --teacher",
    )
    plan.add_argument(
        "--reference",
        choices=REFERENCES[1:],
        help="preference.reference of dpo / ipo: model (a frozen copy laid out like the policy: its parameters and a "
        "forward per micro-batch), lora_base (with --lora-rank: the policy with its adapters off, a forward, no "
        "copy), precomputed (nothing); default lora_base with --lora-rank, else model",
    )
    plan.add_argument(
        "--reference-dtype",
        choices=("float32", "bfloat16"),
        help="preference.reference_dtype: a model reference's storage dtype (default --model-dtype's)",
    )
    plan.add_argument(
        "--teacher",
        help="distill.teacher of --objective distill: a preset, a local Hugging Face model directory or a config.json "
        "(read as --model is, at the student's vocabulary size): its parameters laid out like the student's, its "
        "forward per micro-batch, its final hidden states and both heads' logits in the divergence",
    )
    plan.add_argument(
        "--teacher-dtype",
        choices=("float32", "bfloat16"),
        help="distill.teacher_dtype: the teacher's storage dtype (default: bfloat16 under bf16 compute, else "
        "--model-dtype's)",
    )
    plan.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    plan.add_argument("--json", action="store_true", help="print every candidate as JSON instead of the table")
    plan.add_argument(
        "--emit-config", metavar="OUT.toml", help="write the recommended layout as a meshtron train config"
    )


def resolve_model(spec: str, flag: str = "--model", vocab_size: int | None = None):
    """(Hugging Face config, ModelConfig for a train config) of a preset name, model directory or config.json given
    as ``flag``; ``vocab_size``: a preset's vocabulary (default: the byte tokenizer's)."""
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.presets import ALIASES, PRESETS, make_preset_config, preset_names

    if spec in PRESETS or spec in ALIASES:
        return make_preset_config(spec, vocab_size or load_tokenizer("byte").vocab_size), ModelConfig(preset=spec)
    path = Path(spec).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        from transformers import AutoConfig

        from meshtron.models.build import check_causal_lm_config, check_model_path

        if path.is_dir():
            check_model_path(ModelConfig(name_or_path=str(path)), setting=flag)
            directory = path
        else:
            check_causal_lm_config(path, setting=flag)
            directory = path.parent
        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{flag}: '{spec}' is not a Hugging Face config ({err})") from None
        return config, ModelConfig(name_or_path=str(directory))
    if not path.exists() and (path.suffix == ".json" or os.sep in spec):
        raise ConfigError(
            f"{flag}: '{spec}' does not exist; give a meshtron preset, a local Hugging Face model directory or a "
            "config.json"
        )
    raise ConfigError(
        f"{flag}: '{spec}' is neither a preset ({', '.join(preset_names())}) nor a model directory or config.json"
    )


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _describe_precision(workload) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    chunks = (
        f"fused loss in chunks of {workload.loss_chunk_size} tokens" if workload.loss_chunk_size else "unfused loss"
    )
    return (
        f"{short[workload.model_dtype]} weights + AdamW, {short[workload.compute_dtype]} compute in every layout, "
        f"{chunks}, {'compiled' if workload.compiled else 'eager'} blocks{', float8 linears' * workload.float8}"
    )


def _describe_batch(args: argparse.Namespace, defaulted: set[str]) -> str:
    """``seq L x global batch B``, each marked ``(default)`` where the planner chose it, with the tokens per step."""
    seq = f"seq {args.seq_len}{' (default)' * ('seq_len' in defaulted)}"
    batch = f"global batch {args.global_batch}{' (default)' * ('global_batch' in defaulted)}"
    return f"{seq} x {batch} = {args.seq_len * args.global_batch:,} tokens per step"


def _run_line(out: Path, gpus: int, hw: Hardware) -> str:
    """How to check and start the emitted config, spelled as the user's shell runs it (the config holds every
    degree, so ``--dry-run`` needs no ``--nproc``)."""
    from meshtron.command import meshtron_command

    train = f"{meshtron_command()} train --config {shlex.quote(str(out))}"
    check = f"check a rank's memory with: {train} --dry-run"
    if gpus <= hw.gpus_per_node:
        return f"{check}; run it with: {train} --nproc {gpus}"
    nodes = gpus // hw.gpus_per_node
    return (
        f"{check}; run it on each of the {nodes} nodes with: {train} --nproc {hw.gpus_per_node} --nnodes {nodes} "
        "--node-rank R --rdzv-endpoint FIRST_NODE:PORT --rdzv-id ID --run.output_dir SHARED_DIR "
        "(under SLURM the job gives the node flags: docs/multi-node.md)"
    )


def extended_model(hf_config, model_cfg: ModelConfig, positions: int | None, rope_scaling: str | None) -> ModelConfig:
    """``model_cfg`` with ``--max-position-embeddings`` and ``--rope-scaling`` (applied to ``hf_config`` in place),
    so that the plan and the config it emits train the extended model."""
    from meshtron.config import coerce_value
    from meshtron.models.context_extension import extend_context

    if positions is not None and positions < 1:
        raise ConfigError(f"--max-position-embeddings must be a positive integer, got {positions}")
    scaling = coerce_value("--rope-scaling", rope_scaling, dict[str, Any], from_text=True) if rope_scaling else {}
    model_cfg = dataclasses.replace(model_cfg, max_position_embeddings=positions, rope_scaling=scaling)
    extend_context(hf_config, model_cfg)
    return model_cfg


def plan_reference(args: argparse.Namespace) -> tuple[str, str | None]:
    """(the Workload's reference, reference dtype) of ``--objective``, ``--reference``, ``--reference-dtype`` and
    ``--lora-rank``, as meshtron.config validates and resolves ``[preference]``."""
    takes_reference = args.objective in PREFERENCE_OBJECTIVES and args.objective not in REFERENCE_FREE_OBJECTIVES
    if not takes_reference and (args.reference or args.reference_dtype):
        given = "--reference" if args.reference else "--reference-dtype"
        raise ConfigError(f"{given}: --objective {args.objective} takes no reference model; use dpo or ipo")
    if not takes_reference:
        return "none", None
    reference = args.reference or ("lora_base" if args.lora_rank else "model")
    if reference == "lora_base" and not args.lora_rank:
        raise ConfigError("--reference lora_base is the policy with its LoRA adapters off: add --lora-rank")
    if args.reference_dtype and reference != "model":
        raise ConfigError(f"--reference-dtype: a {reference} reference holds no weights of its own; remove it")
    return reference, args.reference_dtype


def plan_teacher(args: argparse.Namespace, student_config, attn_implementation: str):
    """The Workload's teacher (meshtron.plan.teacher) and teacher dtype of ``--objective distill``, ``--teacher`` and
    ``--teacher-dtype``: the teacher read as ``--model`` is, at the student's vocabulary size; refused in one line
    where one comes without the other."""
    distill = args.objective == "distill"
    if not distill and (args.teacher or args.teacher_dtype):
        given = "--teacher" if args.teacher else "--teacher-dtype"
        raise ConfigError(f"{given}: --objective {args.objective} has no teacher; use --objective distill")
    if not distill:
        return None, None
    if not args.teacher:
        raise ConfigError("--objective distill learns from a teacher: add --teacher PRESET|DIR|CONFIG.json")
    from meshtron.models.teacher import at_student_vocabulary
    from meshtron.plan.teacher import teacher_of

    hf_config, model_cfg = resolve_model(args.teacher, "--teacher", vocab_size=student_config.vocab_size)
    hf_config = at_student_vocabulary(hf_config, student_config, setting="--teacher")
    name = model_cfg.preset or model_cfg.name_or_path
    return teacher_of(name, hf_config, attn_implementation), args.teacher_dtype


def describe_objective(workload) -> str:
    """`` | DPO, reference: ...`` or `` | DISTILL from ...`` for the plan's first line (nothing for causal_lm)."""
    if workload.distill:
        teacher = workload.teacher
        dtype = workload.teacher_storage_dtype
        return f" | DISTILL from {teacher.name} ({teacher.params / 1e9:.2f} B params, {dtype})"
    if not workload.preference:
        return ""
    reference = {
        "none": "none",
        "model": f"a frozen copy ({workload.reference_dtype or workload.model_dtype})",
        "lora_base": "the base (adapters off)",
        "precomputed": "precomputed",
    }[workload.reference]
    return f" | {workload.objective.upper()} on pairs (one a row), reference: {reference}"


def objective_flags(workload) -> str:
    """The ``meshtron plan`` flags of the workload's objective, for an emitted config's header."""
    if workload.distill:
        dtype = f" --teacher-dtype {workload.teacher_dtype}" if workload.teacher_dtype else ""
        return f" --objective distill --teacher {shlex.quote(workload.teacher.name)}{dtype}"
    if not workload.preference:
        return ""
    flags = f" --objective {workload.objective}"
    if workload.reference != "none":
        flags += f" --reference {workload.reference}"
    if workload.reference_dtype:
        flags += f" --reference-dtype {workload.reference_dtype}"
    return flags


def workload_record(workload) -> dict:
    """The workload as ``--json`` writes it: its fields, the teacher by its name and parameter count."""
    record = dict(workload.__dict__)
    if workload.teacher is not None:
        record["teacher"] = {"name": workload.teacher.name, "parameters": workload.teacher.params}
    return record


def run_plan(args: argparse.Namespace) -> int:
    from meshtron.models.build import check_seq_len
    from meshtron.models.families import resolve_attn_implementation
    from meshtron.plan.layout import Workload
    from meshtron.plan.longest import GRANULARITY
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.report import candidate_record, check_new_file, emit_config, format_table
    from meshtron.plan.search import check_cluster, plan_layouts

    for name in ("gpus", "seq_len", "global_batch", "top"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.mlp_tiles < 0:
        raise ConfigError(f"--mlp-tiles must be >= 0 (0 turns tiling off), got {args.mlp_tiles}")
    if args.loss_chunk_size < 0:
        raise ConfigError(f"--loss-chunk-size must be >= 0 (0 disables chunking), got {args.loss_chunk_size}")
    if args.float8_recipe != "tensorwise" and not args.float8:
        raise ConfigError(f"--float8-recipe {args.float8_recipe} plans float8 linears: add --float8")
    overrides = {name: getattr(args, name) for name in HARDWARE_OVERRIDES}
    may_be_zero = ("reserved_gb", "fp8_tflops")  # nothing reserved; a GPU without float8 matmuls
    for name, value in overrides.items():
        if value is not None and not (math.isfinite(value) and (value > 0 or (value == 0 and name in may_be_zero))):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    hw = hardware(args.gpu).with_overrides(
        memory_gb=parse_gigabytes(args.gpu_memory) if args.gpu_memory else None, **overrides
    )
    check_cluster(args.gpus, hw)  # before the model is built: a wrong cluster fails at once
    hf_config, model_cfg = resolve_model(args.model)
    model_cfg = extended_model(hf_config, model_cfg, args.max_position_embeddings, args.rope_scaling)
    if args.emit_config:
        check_new_file(args.emit_config)  # before the search: a path that cannot take the config fails at once
    if args.max_seq_len and args.seq_len is not None:
        raise ConfigError("--seq-len and --max-seq-len: give one (--max-seq-len searches the length)")
    if args.max_seq_len:
        args.global_batch = args.global_batch or 1
        args.seq_len = GRANULARITY  # the search replaces it
    if args.seq_len is not None:
        check_seq_len(hf_config, args.seq_len, setting="--seq-len")
    defaulted = {name for name in ("seq_len", "global_batch") if getattr(args, name) is None}
    if args.seq_len is None:
        args.seq_len = default_seq_len(hf_config)
    if args.global_batch is None:
        args.global_batch = default_global_batch(args.seq_len, args.gpus)
    attn_implementation = resolve_attn_implementation(args.attn_implementation or "auto", hf_config)
    model_cfg = dataclasses.replace(model_cfg, attn_implementation=attn_implementation)
    if args.lora_rank < 0:
        raise ConfigError(f"--lora-rank must be >= 0 (0: full training), got {args.lora_rank}")
    lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None
    shape = ModelShape.from_hf_config(hf_config, model_cfg, lora)
    reference, reference_dtype = plan_reference(args)
    teacher, teacher_dtype = plan_teacher(args, hf_config, attn_implementation)
    if teacher is not None and not args.max_seq_len:
        check_seq_len(teacher.hf_config, args.seq_len, setting="--seq-len (the teacher's positions)")
    workload = Workload(
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        mask_documents=not args.no_mask_documents,
        model_dtype=args.model_dtype,
        compute_dtype=MIXED_PRECISION_DTYPES.get(args.mixed_precision, "float32"),
        loss_chunk_size=args.loss_chunk_size,
        accumulate_unsharded=args.accumulate_unsharded,
        compiled=not args.no_compile,
        attn_implementation=attn_implementation,
        float8=args.float8,
        float8_recipe=args.float8_recipe,
        mlp_tiles=args.mlp_tiles,
        activation_offload=args.activation_offload,
        cpu_offload=args.cpu_offload,
        objective=args.objective,
        reference=reference,
        reference_dtype=reference_dtype,
        teacher=teacher,
        teacher_dtype=teacher_dtype,
    )
    if args.max_seq_len:
        return _print_longest(args, shape, hf_config, workload, hw, model_cfg, lora)
    candidates = plan_layouts(shape, hf_config, workload, args.gpus, hw)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "parameters": shape.total_params,
                    "gpus": args.gpus,
                    "hardware": hw.__dict__,
                    "workload": workload_record(workload),
                    "candidates": [candidate_record(c, args.gpus) for c in candidates],
                },
                indent=1,
            )
        )
    else:
        print(
            f"meshtron plan: {args.model} ({_count(shape.total_params)} parameters, {shape.family}) on {args.gpus} x "
            f"{hw.name}{f' with {hw.memory_gb:g} GB' if args.gpu_memory else ''}, {hw.gpus_per_node} per node | "
            f"{_describe_batch(args, defaulted)} | "
            f"{_describe_precision(workload)}{f' | LoRA rank {args.lora_rank}' if lora else ''}"
            f"{describe_objective(workload)}"
        )
        print(format_table(candidates, args.gpus, hw, args.top))
    fitting = [c for c in candidates if c.fits]
    if args.emit_config:
        if not fitting:
            raise ConfigError("--emit-config: no layout fits, so there is no config to write; see the table")
        best = fitting[0]
        header = (
            f"# Written by: meshtron plan --model {args.model} --gpus {args.gpus} --seq-len {args.seq_len} "
            f"--global-batch {args.global_batch} --gpu {args.gpu} --mixed-precision {args.mixed_precision} "
            f"--loss-chunk-size {args.loss_chunk_size}{' --accumulate-unsharded' * args.accumulate_unsharded}"
            f"{' --no-compile' * args.no_compile}{' --float8' * args.float8}"
            f"{f' --float8-recipe {args.float8_recipe}' * (args.float8 and args.float8_recipe != 'tensorwise')} "
            f"--attn-implementation {attn_implementation}"
            f"{f' --lora-rank {args.lora_rank}' if lora else ''}"
            f"{f' --model-dtype {args.model_dtype}' if args.model_dtype != 'float32' else ''}"
            f"{objective_flags(workload)}\n"
            f"# Predicted per GPU: {best.memory.total / 1e9:.1f} GB, {best.step.tokens_per_s / args.gpus:,.0f} "
            "tokens/s, "
            f"MFU {best.step.mfu:.1%}. Set data.path and data.tokenizer for your data before training.\n\n"
        )
        out = emit_config(best.layout, workload, model_cfg, args.emit_config, header, lora)
        print(f"meshtron plan: wrote {out}; {_run_line(out, args.gpus, hw)}")
    return 0 if fitting else 1


def _print_longest(args, shape, hf_config, base, hw: Hardware, model_cfg, lora) -> int:
    """``--max-seq-len``: print the longest length, the fastest settings that train at it, and emit them."""
    from meshtron.plan.longest import GRANULARITY, longest_sequence
    from meshtron.plan.report import emit_config

    found = longest_sequence(shape, hf_config, base, args.gpus, hw)
    if args.json:
        from meshtron.plan.report import candidate_record

        record = {"model": args.model, "gpus": args.gpus, "hardware": hw.__dict__, "seq_len": found.seq_len}
        record["bound"] = found.bound
        if found.candidate is not None:
            record["workload"] = workload_record(found.workload)
            record["candidate"] = candidate_record(found.candidate, args.gpus)
        print(json.dumps(record, indent=1))
    where = (
        f"{args.model} ({_count(shape.total_params)} parameters{f', LoRA rank {args.lora_rank}' if lora else ''}) on "
        f"{args.gpus} x {hw.name} ({hw.memory_gb:g} GB, {hw.host_memory_gb:g} GB of host memory each), global "
        f"batch {args.global_batch}{describe_objective(base)}"
    )
    if found.candidate is None:
        if not args.json:
            print(
                f"meshtron plan: {where}: no length of {GRANULARITY} tokens or more fits; add GPUs or host memory "
                "(--host-memory-gb), or use LoRA"
            )
        return 1
    best, workload, layout = found.candidate, found.workload, found.candidate.layout
    stopped = {
        "memory": "the next step would not fit in memory",
        "positions": "the model's max_position_embeddings; extend it with --rope-scaling (docs/models.md)",
        "search": "the search's limit",
    }[found.bound]
    degrees = {name: getattr(layout.dims, name) for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    settings = [f"parallel.{name}={value}" for name, value in degrees.items() if value > 1]
    if layout.dims.cp > 1:
        settings.append(f"parallel.cp_method={layout.parallel.cp_method}")
    if layout.dims.cp > 1 and layout.parallel.cp_method == "hybrid":
        settings.append(f"parallel.cp_ulysses={layout.parallel.cp_ulysses}")
    settings += [f"train.activation_checkpointing={layout.activation_checkpointing}"]
    settings += [f"train.activation_offload={str(workload.activation_offload).lower()}"]
    settings += [f"train.mlp_tiles={workload.mlp_tiles}", f"fsdp.cpu_offload={str(workload.cpu_offload).lower()}"]
    text = (
        f"meshtron plan: {where}: the longest sequence is {found.seq_len:,} tokens (stopped by {stopped}), with "
        f"{' '.join(settings)}\n"
        f"  per GPU: {best.memory.total / 1e9:.1f} GB of {hw.memory_gb:g} ({hw.reserved_gb:g} reserved), "
        f"{best.memory.host / 1e9:.1f} GB in host memory; a step of {best.step.seconds:.1f} s, "
        f"{best.step.tokens_per_s / args.gpus:,.0f} tokens/s per GPU (offload copies exposed: "
        f"{best.step.offload_s:.1f} s)"
    )
    if not args.json:
        print(text)
    if args.emit_config:
        header = (
            f"# Written by: meshtron plan --model {args.model} --gpus {args.gpus} --max-seq-len --global-batch "
            f"{args.global_batch} --gpu {args.gpu}{f' --lora-rank {args.lora_rank}' if lora else ''}"
            f"{f' --model-dtype {args.model_dtype}' if args.model_dtype != 'float32' else ''}"
            f"{objective_flags(workload)}\n"
            f"# The longest sequence that fits: {found.seq_len} tokens. Set data.path and data.tokenizer.\n\n"
        )
        out = emit_config(layout, workload, model_cfg, args.emit_config, header, lora)
        print(f"meshtron plan: wrote {out}; {_run_line(out, args.gpus, hw)}")
    return 0


def run_dry_run(cfg: Config, world_size: int, rank: int) -> int:
    """Shard the model for one rank without hardware; print its bytes next to the planner's estimate."""
    from meshtron.plan.dry_run import dry_run
    from meshtron.plan.memory import config_view, param_bytes_of_rank

    report = dry_run(cfg, world_size, rank)
    shape, layout, workload = config_view(cfg, world_size)
    planned = param_bytes_of_rank(shape, layout, workload, rank)
    print(
        f"meshtron dry run: rank {report.rank} of {report.world_size} ({report.layout}), pipeline stages "
        f"{list(report.stages)}: parameters {report.params / 1e9:.3f} GB, gradients {report.grads / 1e9:.3f} GB, "
        f"optimizer state {report.optimizer / 1e9:.3f} GB, total {report.state / 1e9:.3f} GB "
        f"({report.seconds:.1f} s)\n"
        f"meshtron plan estimate for this rank: parameters {planned / 1e9:.3f} GB "
        f"(dry run vs plan: {(report.params - planned) / planned:+.2%})"
    )
    if workload.reference == "model":
        print(_reference_line(shape, layout, workload, rank))
    if workload.teacher is not None:
        print(_teacher_line(layout, workload, rank))
    return 0


def _reference_line(shape, layout, workload, rank: int) -> str:
    """A ``model`` reference's bytes on ``rank``: the planner's (its parameters sharded like the policy's, in
    ``preference.reference_dtype``), which ``meshtron train --rehearse`` measures."""
    from meshtron.plan.memory import reference_param_bytes

    pp_rank = rank // (layout.dims.world_size // layout.dims.pp)
    planned = reference_param_bytes(shape, layout, workload)[pp_rank]
    return (
        f"meshtron plan estimate for this rank's reference model (preference.reference=model: a frozen copy laid out "
        f"like the policy, no gradients or optimizer state): parameters {planned / 1e9:.3f} GB"
    )


def _teacher_line(layout, workload, rank: int) -> str:
    """A distillation teacher's bytes on ``rank``: the planner's (its parameters laid out like the student's, its own
    even pipeline split, in ``distill.teacher_dtype``), which the run measures as ``TrainResult.teacher_bytes``."""
    from meshtron.plan.memory import teacher_bytes_of_rank

    planned = teacher_bytes_of_rank(layout, workload, rank)
    return (
        f"meshtron plan estimate for this rank's teacher ({workload.teacher.name}: frozen, laid out like the student, "
        f"no gradients or optimizer state): parameters {planned / 1e9:.3f} GB"
    )
