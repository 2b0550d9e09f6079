"""Turn a packed micro-batch into the model's inputs (positions, document layout, the cp shard) and its loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtron.distributed.context_parallel import SequenceLayout, planned_tiles, shard_sequence
from meshtron.models.attention import document_ids, document_positions, uses_meshtron_attention
from meshtron.models.attention_kernels import prepare_masks


@dataclass(frozen=True)
class SequenceSplit:
    """How this rank sees a sequence: its context-parallel coordinates and the attention settings."""

    cp: int = 1
    cp_rank: int = 0
    cp_group: object = None
    cp_method: str = "ring"
    mask_documents: bool = False
    eos_token_id: int | None = None
    attention_windows: tuple = (None,)
    """The sliding windows the model's layers use (None: full attention), whose masks are built up front."""


def shard_labels(labels: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """This rank's share of the labels, cut like ``sequence_inputs`` cuts the tokens."""
    return shard_sequence(labels, split.cp, split.cp_rank)


def sequence_inputs(input_ids: torch.Tensor, split: SequenceSplit) -> dict:
    """Token ids, position ids and (when meshtron's attention is in use) the sequence layout, for this rank."""
    docs = document_ids(input_ids, split.eos_token_id) if split.mask_documents else None
    if docs is not None:
        positions = document_positions(docs)
    else:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    kwargs = {
        "input_ids": shard_sequence(input_ids, split.cp, split.cp_rank),
        "position_ids": shard_sequence(positions, split.cp, split.cp_rank),
        "use_cache": False,
    }
    if uses_meshtron_attention(split.cp, split.mask_documents):
        layout = SequenceLayout(input_ids.shape[1], split.cp, split.cp_rank, split.cp_group, split.cp_method, docs)
        # Every layer's attention finds its masks built, outside any compiled block (with cp: the tile
        # plan, whose one host sync happens here and not in the layers; Ulysses attends whole sequences).
        if split.cp == 1 or split.cp_method == "ulysses":
            prepare_masks(layout.attention_cache, docs, input_ids.device, input_ids.shape[1], split.attention_windows)
        else:
            for window in split.attention_windows:
                planned_tiles(layout, input_ids.device, window)
        kwargs["sequence_layout"] = layout
    return kwargs
