"""The training data of a run: the dataset and its global batch order, from ``data.path`` or ``data.sources``."""

from __future__ import annotations

from dataclasses import replace

from meshtron.config import DataConfig
from meshtron.data.chat import build_chat_dataset
from meshtron.data.dataset import build_packed_dataset
from meshtron.data.mixture import MixedDataset, MixtureSchedule, parse_sources
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.streaming import StreamingDataset, StreamSchedule


def build_training_data(data: DataConfig, tokenizer, global_batch_size: int, *, is_builder: bool, run_id: str = ""):
    """(dataset, schedule): one corpus, or a weighted mixture of several (meshtron.data.mixture).

    Each source is a prepared directory or any other source, prepared into ``data.cache_dir`` first; local
    rank 0 of each machine builds what is missing (the others wait outside any collective). With ``data.streaming``
    the source is read while training runs (meshtron.data.streaming)."""
    if data.format == "chat":  # fine-tuning conversations, packed in memory (meshtron.data.chat)
        dataset = build_chat_dataset(data, tokenizer)
        return dataset, GlobalBatchSchedule(len(dataset), global_batch_size, data.shuffle, data.seed)
    if data.streaming:
        return StreamingDataset(data, tokenizer, global_batch_size), StreamSchedule(global_batch_size, data.seed)
    if not data.sources:
        dataset = build_packed_dataset(data, tokenizer, is_builder=is_builder, run_id=run_id)
        return dataset, GlobalBatchSchedule(len(dataset), global_batch_size, data.shuffle, data.seed)
    sources = parse_sources(data.sources)
    datasets = [
        build_packed_dataset(replace(data, path=path), tokenizer, is_builder=is_builder, run_id=run_id)
        for path, _ in sources
    ]
    schedule = MixtureSchedule(
        [len(d) for d in datasets], [w for _, w in sources], global_batch_size, data.shuffle, data.seed
    )
    return MixedDataset(datasets), schedule
