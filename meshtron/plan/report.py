"""``meshtron plan``'s outputs: the ranked table, JSON, and a ready ``meshtron train`` config."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from meshtron.config import Config, LoraConfig, ModelConfig, to_toml
from meshtron.errors import ConfigError
from meshtron.plan.hardware import Hardware
from meshtron.plan.layout import Layout, Workload
from meshtron.plan.search import AC_MODES, Candidate

GB = 1e9


def layout_record(layout: Layout) -> dict:
    """The layout as ``meshtron plan --json`` writes it: its degrees and its other settings in one flat record."""
    dims = dataclasses.asdict(layout.dims)
    options = dataclasses.asdict(layout.parallel)
    del options["pp_microbatches"]  # the micro-batch says it
    options["pp_stages_per_rank"] = layout.stages_per_rank
    return {
        **{k: v for k, v in dims.items() if k != "ep"},
        "micro_batch": layout.micro_batch,
        "activation_checkpointing": layout.activation_checkpointing,
        **options,
        "ep": dims["ep"],
    }


def candidate_record(c: Candidate, gpus: int) -> dict:
    m, s = c.memory, c.step
    return {
        "layout": layout_record(c.layout),
        "fits": c.fits,
        "memory_gb": {
            "params": m.params / GB,
            "grads": m.grads / GB,
            "optimizer": m.optimizer / GB,
            "activations": m.activations / GB,
            "gathered": m.gathered / GB,
            "temporaries": m.temporaries / GB,
            "reference": m.reference / GB,
            "reference_forward": m.reference_forward / GB,
            "teacher": m.teacher / GB,
            "teacher_hidden": m.teacher_hidden / GB,
            "teacher_head": m.teacher_head / GB,
            "teacher_forward": m.teacher_forward / GB,
            "total": m.total / GB,
            "state_at_peak": m.peak_state / GB,
            "host": m.host / GB,
        },
        "step_s": s.seconds,
        "compute_s": s.compute_s,
        "exposed_comm_s": s.exposed_comm_s,
        "all_to_all_s": s.all_to_all_s,
        "offload_s": s.offload_s,
        "tokens_per_s": s.tokens_per_s,
        "tokens_per_s_per_gpu": s.tokens_per_s / gpus,
        "mfu": s.mfu,
        "cp_method": c.layout.parallel.cp_method if c.layout.dims.cp > 1 else None,
    }


def cp_method_label(layout: Layout) -> str:
    """The layout's ``parallel.cp_method`` as the table shows it: ``hybrid:U`` with its ``parallel.cp_ulysses``, "-"
    without context parallelism."""
    if layout.dims.cp == 1:
        return "-"
    return (
        f"hybrid:{layout.parallel.cp_ulysses}" if layout.parallel.cp_method == "hybrid" else layout.parallel.cp_method
    )


def _layout_cell(layout: Layout) -> str:
    d = layout.dims
    return f"{d.pp:>2} {d.dp_replicate:>4} {d.dp_shard:>5} {d.cp:>2} {d.tp:>2} {d.ep:>3}"


def describe_layout(layout: Layout, checkpointing: bool = True) -> str:
    """A layout in a few words: its degrees above 1 (with the CP method), micro batch and checkpointing."""
    method = f" ({cp_method_label(layout)})" if layout.dims.cp > 1 else ""
    mode = f", {layout.activation_checkpointing} checkpointing" if checkpointing else ""
    return f"{layout.dims.describe()}{method}, micro batch {layout.micro_batch}{mode}"


def checkpointing_note(candidates: list[Candidate], hw: Hardware) -> str | None:
    """Why the recommended layout checkpoints activations, when it does because nothing fits with less: one line
    naming the smallest layout of each lighter mode (``none``, and ``selective`` under ``full``) and what it needs,
    from the estimates the search already made. None when the recommendation needs no explaining."""
    fitting = [c for c in candidates if c.fits]
    if not fitting or fitting[0].layout.activation_checkpointing == "none":
        return None
    mode = fitting[0].layout.activation_checkpointing
    usable = hw.memory_gb - hw.reserved_gb
    reasons = []
    for lighter in AC_MODES[: AC_MODES.index(mode)]:
        tried = [c for c in candidates if c.layout.activation_checkpointing == lighter]
        if not tried or any(c.fits for c in tried):
            continue
        smallest = min(tried, key=lambda c: c.memory.total)
        needs = f"({describe_layout(smallest.layout, checkpointing=False)}) needs {smallest.memory.total / GB:.1f} GB"
        if lighter == "none":
            reasons.append(
                f"no layout fits without activation checkpointing: the smallest plain one {needs} of the "
                f"{usable:g} GB usable per GPU"
            )
        else:
            reasons.append(f"none fits with {lighter} checkpointing either: the smallest {needs}")
    return "; ".join(reasons) if reasons else None


def format_table(candidates: list[Candidate], gpus: int, hw: Hardware, top: int) -> str:
    """The ``top`` best layouts that fit, the recommended one marked with ``*``; under them how many fit and why
    the recommendation checkpoints activations (checkpointing_note) or, when nothing fits, what is closest."""
    fitting = [c for c in candidates if c.fits]
    usable = hw.memory_gb - hw.reserved_gb
    header = (
        "   pp  rep shard cp tp  ep | micro  ckpt       cp method  schedule        | GB/rank: state  act  other  total "
        "| step s  tok/s/GPU   MFU"
    )
    lines = [header, "-" * len(header)]
    for index, c in enumerate(fitting[:top]):
        m, s, layout = c.memory, c.step, c.layout
        schedule = layout.parallel.pp_schedule if layout.dims.pp > 1 else "-"
        method = cp_method_label(layout)
        lines.append(
            f"{'*' if index == 0 else ' '} {_layout_cell(layout)} | {layout.micro_batch:>5}  "
            f"{layout.activation_checkpointing:<9}  {method:<9}  {schedule:<15} | "
            f"{m.peak_state / GB:>13.1f} {m.activations / GB:>4.1f} "
            f"{(m.gathered + m.temporaries) / GB:>6.1f} "
            f"{m.total / GB:>6.1f} | {s.seconds:>6.2f} {s.tokens_per_s / gpus:>10,.0f} {s.mfu:>5.1%}"
        )
    rejected = len(candidates) - len(fitting)
    lines.append(
        f"{len(fitting)} of {len(candidates)} layouts fit in {usable:.0f} GB per GPU ({hw.memory_gb:.0f} GB less "
        f"{hw.reserved_gb:.0f} GB reserved); {rejected} need more memory."
    )
    note = checkpointing_note(candidates, hw)
    if note:
        lines.append(f"meshtron plan: {note}.")
    if not fitting:
        smallest = min(candidates, key=lambda c: c.memory.total)
        lines.append(
            f"meshtron plan: nothing fits; the smallest layout needs {smallest.memory.total / GB:.1f} GB per GPU "
            f"({describe_layout(smallest.layout)}): add GPUs, shorten --seq-len or use bigger GPUs"
        )
    return "\n".join(lines)


def train_config(layout: Layout, workload: Workload, model_cfg: ModelConfig, lora: LoraConfig | None = None) -> Config:
    """The ``meshtron train`` config that runs ``layout``: master weights in the workload's model dtype,
    compute in its compute dtype (``precision.mixed_precision``, every layout), its loss chunk size and attention. The
    per-forward batch is ``train.micro_batch_size`` in every layout (under pp, the pipeline microbatch). ``lora``:
    a LoRA run's ``[lora]``."""
    cfg = Config()
    if lora is not None:
        cfg.lora = lora
    cfg.model = dataclasses.replace(model_cfg)
    workload.write_to(cfg)
    layout.write_to(cfg)
    return cfg


def check_new_file(path: str | os.PathLike) -> Path:
    """``path``, where a new file can go: not there yet (never overwrite what a user has), not under a file."""
    target = Path(path)
    if target.exists():
        raise ConfigError(f"--emit-config: '{target}' already exists; choose a new file name")
    folder = next((parent for parent in target.parents if parent.exists()), None)
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"--emit-config: cannot write '{target}': '{folder}' is a file, not a folder")
    return target


def write_new_file(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a new file (see check_new_file)."""
    target = check_new_file(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "x") as handle:
            handle.write(text)
    except OSError as err:
        raise ConfigError(f"--emit-config: cannot write '{target}' ({err}); choose a writable path") from None
    return target


def emit_config(
    layout: Layout,
    workload: Workload,
    model_cfg: ModelConfig,
    path: str | os.PathLike,
    header: str = "",
    lora: LoraConfig | None = None,
) -> Path:
    return write_new_file(path, header + to_toml(train_config(layout, workload, model_cfg, lora)))
