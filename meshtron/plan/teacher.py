"""The teacher of ``train.objective=distill`` as the planner counts it: its name (``distill.teacher``), its Hugging
Face config at the student's vocabulary size (meshtron.models.teacher) and its anatomy (a ModelShape of its own).

``meshtron plan --teacher`` reads it as ``--model`` is read (a preset, a model folder or a config.json:
``plan.cli.resolve_model``); ``Workload.from_config`` as preflight does (meshtron.models.teacher). Its memory and
time terms are in ``memory.py`` and ``throughput.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshtron.config import Config, ModelConfig
from meshtron.plan.model_shape import ModelShape


@dataclass(frozen=True)
class Teacher:
    """A distillation run's teacher: frozen, forward only, laid out like the student (its own even pipeline split)."""

    name: str
    """``distill.teacher`` as an emitted config writes it: a preset name or a model folder."""
    shape: ModelShape
    """Its parameters and anatomy (no LoRA: the teacher is never adapted)."""
    hf_config: Any = field(compare=False, repr=False)
    """Its Hugging Face config at the student's vocabulary size (for its FLOPs and the layout checks)."""

    @property
    def params(self) -> int:
        return self.shape.total_params


def teacher_of(name: str, hf_config, attn_implementation: str) -> Teacher:
    """The Teacher named ``name`` whose config (already at the student's vocabulary) is ``hf_config``, built with the
    student's attention implementation as meshtron.models.teacher builds it."""
    return Teacher(
        name=name,
        shape=ModelShape.from_hf_config(hf_config, ModelConfig(attn_implementation=attn_implementation)),
        hf_config=hf_config,
    )


def config_teacher(cfg: Config, student_config=None) -> Teacher | None:
    """The teacher of a ``train.objective=distill`` config, resolved as preflight resolves it (the data's tokenizer,
    the student's vocabulary); None for every other objective. ``student_config``: the student's Hugging Face config
    where the caller has it."""
    if cfg.train.objective != "distill" or not cfg.distill.teacher:
        return None
    from meshtron.data.hub import model_folder
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.models.build import load_hf_config
    from meshtron.models.teacher import load_teacher_config, teacher_model_config

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code, model_folder(cfg.model))
    if student_config is None:
        student_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    teacher_model = teacher_model_config(cfg.distill, cfg.model)
    hf_config = load_teacher_config(teacher_model, tokenizer.vocab_size, student_config)
    return teacher_of(cfg.distill.teacher, hf_config, cfg.model.attn_implementation)
