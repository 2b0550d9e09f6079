"""The teacher of ``train.objective=distill``: its model settings and Hugging Face config, resolved and checked
against the student's before any process group exists.

The teacher is built at the student's vocabulary size: a teacher whose checkpoint pads its vocabulary further
(extra rows that no token id of the shared tokenizer reaches) has only its first rows read (meshtron.models.build,
``CHECKPOINT_VOCAB_ATTRIBUTE``), so that both heads split alike over the vocabulary under tensor parallelism.
"""

from __future__ import annotations

from pathlib import Path

from meshtron.config import DistillConfig, ModelConfig
from meshtron.errors import ConfigError
from meshtron.models.build import CHECKPOINT_VOCAB_ATTRIBUTE, check_model_path, load_hf_config
from meshtron.models.presets import ALIASES, PRESETS

SETTING = "distill.teacher"


def teacher_model_config(distill: DistillConfig, student: ModelConfig) -> ModelConfig:
    """``[model]`` of the teacher: a preset by name, else a model folder (or hub id); the student's attention
    settings, ``distill.teacher_dtype`` (or the student's dtype) for its weights, never the student's context
    extension (the teacher's own positions apply)."""
    name = distill.teacher or ""
    is_preset = (name in PRESETS or name in ALIASES) and not Path(name).expanduser().exists()
    return ModelConfig(
        name_or_path=None if is_preset else name,
        preset=name if is_preset else None,
        dtype=distill.teacher_dtype or student.dtype,
        attn_implementation=student.attn_implementation,
        attention_kernel=student.attention_kernel,
        trust_remote_code=student.trust_remote_code,
    )


def load_teacher_config(teacher: ModelConfig, tokenizer_vocab_size: int, student_config):
    """The teacher's Hugging Face config, at the student's vocabulary size; a one-line ConfigError where the
    teacher's folder is not a causal LM or its vocabulary cannot hold the student's."""
    check_model_path(teacher, SETTING)
    try:
        config = load_hf_config(teacher, tokenizer_vocab_size)
    except ConfigError as err:
        raise ConfigError(f"{SETTING}: {err}") from None
    return at_student_vocabulary(config, student_config)


def at_student_vocabulary(config, student_config, setting: str = SETTING):
    """The teacher's Hugging Face ``config``, changed in place to the student's vocabulary size (a larger padded
    vocabulary's first rows are read); a one-line ConfigError naming ``setting`` where it is smaller."""
    student_vocab, teacher_vocab = student_config.vocab_size, config.vocab_size
    if teacher_vocab < student_vocab:
        raise ConfigError(
            f"{setting}: the teacher's vocabulary has {teacher_vocab} ids but the student's has {student_vocab}; "
            "distillation compares their next-token distributions id by id: use a teacher of the student's "
            "tokenizer (the same vocabulary, or a larger padded one)"
        )
    if teacher_vocab > student_vocab:  # padded further: its first rows are the shared ids
        setattr(config, CHECKPOINT_VOCAB_ATTRIBUTE, teacher_vocab)
        config.vocab_size = student_vocab
    return config
