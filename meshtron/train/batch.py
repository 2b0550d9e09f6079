"""Turn a packed micro-batch into the model's inputs (positions, document layout, the cp shard) and its loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtron.distributed.context_parallel import SequenceLayout, shard_sequence
from meshtron.models.attention import document_ids, document_positions, uses_meshtron_attention


IGNORE_INDEX = -100
"""Label value that carries no loss."""


@dataclass(frozen=True)
class SequenceSplit:
    """How this rank sees a sequence: its context-parallel coordinates and the attention settings."""

    cp: int = 1
    cp_rank: int = 0
    cp_group: object = None
    cp_method: str = "ring"
    mask_documents: bool = False
    eos_token_id: int | None = None
    pp: int = 1


def shard_labels(labels: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """This rank's share of the labels, cut like ``sequence_inputs`` cuts the tokens."""
    return shard_sequence(labels, split.cp, split.cp_rank)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the labelled tokens, in float32 (vocab-sharded logits under loss parallel)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


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
    if uses_meshtron_attention(split.cp, split.mask_documents, split.pp):
        kwargs["sequence_layout"] = SequenceLayout(
            input_ids.shape[1], split.cp, split.cp_rank, split.cp_group, split.cp_method, docs
        )
    return kwargs
