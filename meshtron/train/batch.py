"""Turn a packed micro-batch into the model's inputs (positions, document layout, the cp shard) and its loss."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshtron.distributed.context_parallel import (
    HybridGroups,
    SequenceLayout,
    chunk_document_bounds,
    planned_tiles,
    shard_sequence,
)
from meshtron.distributed.context_parallel.hybrid import ring_layout
from meshtron.models.attention import document_ids, document_positions, uses_meshtron_attention
from meshtron.models.attention_kernels import document_lengths, prepare_masks

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class SequenceSplit:
    """How this rank sees a sequence: its context-parallel coordinates and the attention settings."""

    cp: int = 1
    cp_rank: int = 0
    cp_group: ProcessGroup | None = None
    cp_method: str = "ring"
    hybrid: HybridGroups | None = None
    """With ``cp_method=hybrid``: this rank's Ulysses and ring groups (``context_parallel.hybrid_groups``)."""
    mask_documents: bool = False
    eos_token_id: int | None = None
    attention_windows: tuple = (None,)
    """The sliding windows the model's layers use (None: full attention), whose masks are built up front."""
    attention_kernel: str = "auto"
    """``model.attention_kernel`` (a run's: resolved by preflight, RunSetup.attention_kernel): the kernel of
    whole-sequence document attention (cp = 1, or Ulysses)."""


def shard_labels(labels: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """This rank's share of the labels, cut like ``sequence_inputs`` cuts the tokens."""
    return shard_sequence(labels, split.cp, split.cp_rank)


def plans_tiles(split: SequenceSplit) -> bool:
    """Whether attention plans context-parallel tiles from document bounds (ring / all-gather / hybrid with
    documents)."""
    return split.cp > 1 and split.cp_method != "ulysses" and split.mask_documents


def uses_varlen(split: SequenceSplit) -> bool:
    """Whether whole-sequence document attention runs the varlen kernel (it needs the documents' lengths)."""
    return split.cp == 1 and split.mask_documents and split.attention_kernel == "varlen"


def host_document_bounds(input_ids: torch.Tensor, split: SequenceSplit) -> tuple | torch.Tensor | None:
    """What attention needs to know of the documents, from token ids still in host memory: no device sync. The
    tile plan's bounds (``SequenceLayout.document_bounds``) with cp tiles; the documents' cumulative lengths
    (``attention_kernels.document_lengths``, a host tensor) for the varlen kernel; None otherwise."""
    if input_ids.device.type != "cpu":
        return None
    if plans_tiles(split):
        return chunk_document_bounds(document_ids(input_ids, split.eos_token_id), split.cp)
    if uses_varlen(split):
        return document_lengths(document_ids(input_ids, split.eos_token_id))
    return None


def sequence_inputs(
    input_ids: torch.Tensor, split: SequenceSplit, document_bounds: tuple | torch.Tensor | None = None
) -> dict:
    """Token ids, position ids and (when meshtron's attention is in use) the sequence layout, for this rank.
    ``document_bounds``: ``host_document_bounds`` of these rows (or of a batch holding them), so that the tile
    plan or the varlen kernel reads nothing back from the device; None: it reads them once."""
    docs = document_ids(input_ids, split.eos_token_id) if split.mask_documents else None
    lengths = None
    if isinstance(document_bounds, torch.Tensor):  # the varlen kernel's, of these rows only (host: no sync)
        lengths = document_bounds if int(document_bounds[-1]) == input_ids.numel() else None
        document_bounds = None
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
        layout = SequenceLayout(
            input_ids.shape[1],
            split.cp,
            split.cp_rank,
            split.cp_group,
            split.cp_method,
            docs,
            document_bounds=document_bounds if docs is not None else None,
            document_kernel=split.attention_kernel,
            hybrid=split.hybrid,
        )
        # Every layer's attention finds its masks built, outside any compiled block (with cp: the tile
        # plan, here and not in the layers; Ulysses attends whole sequences).
        if split.cp == 1 or split.cp_method == "ulysses":
            prepare_masks(
                layout.attention_cache,
                docs,
                input_ids.device,
                input_ids.shape[1],
                split.attention_windows,
                kernel=layout.document_kernel,
                lengths=lengths,
            )
        else:  # hybrid: the tiles of its ring across the groups
            tiled = ring_layout(layout) if split.cp_method == "hybrid" else layout
            for window in split.attention_windows:
                planned_tiles(tiled, input_ids.device, window)
        kwargs["sequence_layout"] = layout
    return kwargs


class StageInputs:
    """``sequence_inputs`` as a pipeline stage's forward calls it (``inputs_for`` of
    meshtron.distributed.pipeline_parallel.set_stage_forward), with the document bounds of the step's whole batch,
    set by the runner for the step (``during``): the stage's forward then plans tiles with no device sync."""

    def __init__(self, split: SequenceSplit):
        self.split = split
        self.document_bounds: tuple | torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor) -> dict:
        return sequence_inputs(input_ids, self.split, self.document_bounds)

    @contextlib.contextmanager
    def during(self, document_bounds: tuple | None):
        """The bounds hold for the forwards inside (a step's microbatches) only; after, the plan reads them."""
        self.document_bounds = document_bounds
        try:
            yield
        finally:
            self.document_bounds = None
