"""The data of a run: the training dataset and its global batch order, from ``data.path`` or ``data.sources``, and
the evaluation dataset (``eval.path``, or the documents ``eval.holdout_documents`` keeps out of training)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from meshtron.config import DataConfig, EvalConfig, PreferenceConfig, parse_batch_rampup
from meshtron.data.chat import ChatDataset, build_chat_datasets
from meshtron.data.dataset import PackedDataset, build_packed_dataset
from meshtron.data.mixture import MixedDataset, MixtureSchedule, parse_sources
from meshtron.data.preference import PreferenceDataset, build_preference_datasets
from meshtron.data.sampler import BatchSizes, GlobalBatchSchedule
from meshtron.data.streaming import StreamingDataset, StreamSchedule
from meshtron.errors import ConfigError, MeshtronError


class TrainingDataset(Protocol):
    """What training and evaluation read of a dataset (packed, mixed, chat, preference or streamed): sequences by
    index. One whose labels are not every next token of its rows (chat, preference, streams) also counts them,
    ``target_count(indices)`` (meshtron.train.step_stats.global_target_count)."""

    def rows(self, indices) -> np.ndarray:
        """The packed sequences ``indices``, one row each (``data.seq_len + 1`` tokens)."""
        ...

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels) of the sequences ``indices``."""
        ...


@dataclass
class RunData:
    """What a run reads: the training dataset, its global batch order, and the evaluation dataset."""

    dataset: TrainingDataset
    schedule: GlobalBatchSchedule
    eval_dataset: TrainingDataset | None = None
    """Sequences to evaluate on, in order (None without ``[eval]``); see meshtron.train.evaluation.evaluate."""


def build_training_data(
    data: DataConfig,
    tokenizer,
    global_batch_size: int,
    *,
    is_builder: bool,
    run_id: str = "",
    evaluation: EvalConfig | None = None,
    batch_rampup: str = "",
    preference: PreferenceConfig | None = None,
    prompt_nll: bool = False,
) -> RunData:
    """One corpus, or a weighted mixture of several (meshtron.data.mixture), and the evaluation data.

    Each source is a prepared directory or any other source, prepared into ``data.cache_dir`` first; local
    rank 0 of each machine builds what is missing (the others wait outside any collective). With ``data.streaming``
    the source is read while training runs (meshtron.data.streaming). ``batch_rampup``: ``train.batch_rampup``
    (meshtron.data.sampler.BatchSizes). ``preference``: ``[preference]``, read with ``data.format=preference``;
    ``prompt_nll``: its pairs' chosen prompts labelled for the NLL term (ORPO's; meshtron.data.preference)."""
    evaluation = evaluation or EvalConfig()
    held_out = evaluation.holdout_documents
    sizes = BatchSizes(global_batch_size, parse_batch_rampup(batch_rampup, global_batch_size))
    preference = preference or PreferenceConfig()
    dataset: ChatDataset | PreferenceDataset | StreamingDataset | PackedDataset | MixedDataset
    eval_dataset: ChatDataset | PreferenceDataset | PackedDataset | None = None
    if data.format == "preference":  # one pair a row, built in memory (meshtron.data.preference)
        dataset, eval_dataset = build_preference_datasets(data, preference, tokenizer, held_out, prompt_nll=prompt_nll)
        schedule = GlobalBatchSchedule(len(dataset), global_batch_size, data.shuffle, data.seed, sizes)
    elif data.format == "chat":  # fine-tuning conversations, packed in memory (meshtron.data.chat)
        dataset, eval_dataset = build_chat_datasets(data, tokenizer, held_out)
        schedule = GlobalBatchSchedule(len(dataset), global_batch_size, data.shuffle, data.seed, sizes)
    elif data.streaming:
        dataset = StreamingDataset(data, tokenizer, global_batch_size)
        schedule = StreamSchedule(global_batch_size, data.seed)
    elif not data.sources:
        dataset = build_packed_dataset(data, tokenizer, is_builder=is_builder, run_id=run_id)
        if held_out:
            dataset, eval_dataset = dataset.split_documents(held_out, data.path)
        schedule = GlobalBatchSchedule(len(dataset), global_batch_size, data.shuffle, data.seed, sizes)
    else:
        sources = parse_sources(data.sources)
        datasets = [
            build_packed_dataset(replace(data, path=path), tokenizer, is_builder=is_builder, run_id=run_id)
            for path, _ in sources
        ]
        schedule = MixtureSchedule(
            [len(d) for d in datasets], [w for _, w in sources], global_batch_size, data.shuffle, data.seed, sizes
        )
        dataset = MixedDataset(datasets)
    if evaluation.path:
        eval_dataset = _build_eval_path(
            data, evaluation.path, tokenizer, dataset, is_builder, run_id, preference, prompt_nll
        )
    if eval_dataset is not None and len(eval_dataset) < global_batch_size:
        source = f"eval.path '{evaluation.path}'" if evaluation.path else f"eval.holdout_documents={held_out}"
        raise ConfigError(
            f"{source} gives {len(eval_dataset)} sequences of data.seq_len + 1 = {data.seq_len + 1} tokens, fewer "
            f"than one global batch (train.global_batch_size={global_batch_size}); evaluate on more data"
        )
    return RunData(dataset, schedule, eval_dataset)


def _build_eval_path(
    data: DataConfig,
    path: str,
    tokenizer,
    training,
    is_builder: bool,
    run_id: str,
    preference: PreferenceConfig,
    prompt_nll: bool = False,
):
    """``eval.path`` read as ``data.path`` would be (whole: ``data.max_documents`` limits the training data only)."""
    source = replace(data, path=path, max_documents=None, streaming=False, sources=[])
    try:
        if data.format == "preference":
            return build_preference_datasets(
                source, preference, tokenizer, separator=training.separator, prompt_nll=prompt_nll
            )[0]
        if data.format == "chat":
            return build_chat_datasets(source, tokenizer, separator=training.separator)[0]
        return build_packed_dataset(source, tokenizer, is_builder=is_builder, run_id=run_id, setting="eval.path")
    except MeshtronError as err:  # the readers name data.path (and its fix), whose reading eval.path shares
        text = str(err)
        raise type(err)(text.replace("data.path", "eval.path") if text.startswith("data.path") else text) from None
