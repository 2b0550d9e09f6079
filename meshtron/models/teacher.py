"""The teacher of ``train.objective=distill``: its model settings and Hugging Face config, resolved and checked
against the student's before any process group exists.

The teacher is built at the student's vocabulary size: a teacher whose checkpoint pads its vocabulary further
(extra rows that no token id of the shared tokenizer reaches) has only its first rows read (meshtron.models.build,
``CHECKPOINT_VOCAB_ATTRIBUTE``), so that both heads split alike over the vocabulary under tensor parallelism.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from meshtron.config import DistillConfig, ModelConfig, teacher_storage_dtype
from meshtron.data.hub import is_hub_id, local_folder, model_folder, snapshot_commit
from meshtron.errors import ConfigError, MeshtronError
from meshtron.models.build import CHECKPOINT_VOCAB_ATTRIBUTE, CheckpointReader, check_model_path, load_hf_config
from meshtron.models.presets import ALIASES, PRESETS

SETTING = "distill.teacher"


def teacher_model_config(distill: DistillConfig, student: ModelConfig, compute_dtype: str | None = None) -> ModelConfig:
    """``[model]`` of the teacher: a preset by name, else a model folder (or hub id); the student's attention
    settings and ``model.trust_remote_code``, its storage dtype (``teacher_storage_dtype``; ``compute_dtype``: the
    run's under mixed precision, None without), never the student's context extension (the teacher's own positions
    apply)."""
    name = distill.teacher or ""
    is_preset = (name in PRESETS or name in ALIASES) and not Path(name).expanduser().exists()
    return ModelConfig(
        name_or_path=None if is_preset else name,
        preset=name if is_preset else None,
        dtype=teacher_storage_dtype(distill.teacher_dtype, student.dtype, compute_dtype),
        attn_implementation=student.attn_implementation,
        attention_kernel=student.attention_kernel,
        trust_remote_code=student.trust_remote_code,
    )


def pinned_teacher(teacher: ModelConfig) -> ModelConfig:
    """A teacher named by hub id fixed to the commit its snapshot resolved to (fetched once per machine, as the
    student's is), so that every later load reads the same weights; a local folder made absolute (as the student's:
    found from any working directory); a preset as it is. One line naming ``distill.teacher`` where the id is
    neither cached nor fetched."""
    if not teacher.name_or_path:
        return teacher
    if not is_hub_id(teacher.name_or_path):
        return replace(teacher, name_or_path=os.path.abspath(os.path.expanduser(teacher.name_or_path)))
    folder = local_folder(teacher.name_or_path, teacher.revision, teacher.trust_remote_code, SETTING)
    return replace(teacher, revision=snapshot_commit(folder))


def load_teacher_config(teacher: ModelConfig, tokenizer_vocab_size: int, student_config):
    """The teacher's Hugging Face config, at the student's vocabulary size; a one-line ConfigError where the
    teacher's folder is not a causal LM or its vocabulary cannot hold the student's (``tokenizer_vocab_size``, the
    data's tokenizer's, is within the student's)."""
    teacher = pinned_teacher(teacher)
    check_model_path(teacher, SETTING)
    if teacher.name_or_path:
        _check_weights(model_folder(teacher))
    student_vocab = student_config.vocab_size
    # A preset is made at the student's vocabulary. A folder's is compared with the student's below, in the
    # teacher's words: 0 skips load_hf_config's comparison with the tokenizer, worded for the student's model.
    try:
        config = load_hf_config(teacher, 0 if teacher.name_or_path else max(student_vocab, tokenizer_vocab_size))
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
        if isinstance(getattr(config, "pad_token_id", None), int) and config.pad_token_id >= student_vocab:
            # A padding id among the rows left unread (no student id reaches it) would be out of the embedding's
            # range; it only shapes the embedding's gradient, which a frozen teacher never has.
            config.pad_token_id = None
    return config


def _check_weights(folder: str) -> None:
    """Refuse a teacher folder without weights now, in the teacher's words, rather than when the run builds it."""
    try:
        CheckpointReader(folder)
    except MeshtronError:
        raise ConfigError(
            f"{SETTING}: '{folder}' has no model.safetensors or pytorch_model.bin weights; a teacher needs its trained "
            "weights (a preset name gives random ones, for tests)"
        ) from None


def check_teacher_positions(teacher_config, seq_len: int) -> None:
    """Refuse sequences longer than the teacher's positions: the student's ``model.rope_scaling`` does not extend
    the teacher's, whose own ``max_position_embeddings`` apply."""
    positions = getattr(teacher_config, "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise ConfigError(
            f"{SETTING}: data.seq_len {seq_len} is longer than the teacher's max_position_embeddings {positions} "
            f"(the student's model.rope_scaling does not apply to the teacher); use data.seq_len <= {positions}, "
            "or a teacher of a longer context"
        )
