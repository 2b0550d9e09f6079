"""The load-balanced split of a sequence over the ``cp`` ranks, and what attention knows about it.

The sequence is cut into ``2*cp`` chunks and rank r holds chunks r and 2*cp-1-r (``chunk_ids``), so under
the causal mask every rank does the same attention work. Token ids, labels and position ids are sharded
with the same index (``shard_sequence``); RoPE gets the global positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtron.errors import ConfigError


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2*cp``) that ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def check_context_parallel(cp: int, seq_len: int) -> None:
    """Refuse a sequence length the load-balanced split cannot cut into ``2*cp`` equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"data.seq_len {seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (each cp rank holds two "
            f"equal chunks); use a data.seq_len that is a multiple of {2 * cp}"
        )


def local_token_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens ``rank`` holds, in its local order."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp, rank)])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's load-balanced share of ``tensor`` (B, S, ...) along dim 1."""
    if cp == 1:
        return tensor
    return tensor.index_select(1, local_token_index(tensor.shape[1], cp, rank, tensor.device))


@dataclass(frozen=True)
class HybridGroups:
    """The process groups of ``parallel.cp_method=hybrid`` (``hybrid.hybrid_groups``): the cp ranks form groups of
    ``ulysses`` consecutive ones; cp rank r is rank ``r % ulysses`` of its Ulysses group and rank ``r // ulysses``
    of its ring, the ``cp / ulysses`` ranks with its place in their groups."""

    ulysses: int
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup


@dataclass(frozen=True)
class SequenceLayout:
    """What attention needs to know about the sequence: its sharding and its documents.

    ``document_ids`` covers the *whole* sequence (B, S) (every cp rank has the full micro-batch), or is
    None when all tokens of a row form one document.
    """

    seq_len: int
    cp: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    method: str = "ring"
    document_ids: torch.Tensor | None = None
    kernel: str = "auto"
    """``auto`` (the device's fused kernels), ``math`` (plain PyTorch) or ``flex`` (FlexAttention for the
    document-masked tiles on any device), for tests: see ``tiles.KERNELS``."""
    attention_cache: dict = field(default_factory=dict, compare=False, repr=False)
    """Masks that attention builds once for this micro-batch and every layer reuses (the tile plan
    with cp, one per sliding window)."""
    document_ranges: dict = field(default_factory=dict, compare=False, repr=False)
    """Each cp chunk's first and last document id with the document ids on a device, found by the first plan
    and reused by the plans of other sliding windows (``planned_tiles``)."""
    document_bounds: tuple | None = field(default=None, compare=False, repr=False)
    """``(first, last)``: each row's first and last document id per chunk (``chunk_document_bounds``), known on
    the host from the batch before it went to the device, so that planning reads nothing back from it. Its rows
    may be more than ``document_ids``' (a pipeline step's whole batch for each of its microbatches): a tile
    skipped, full or causal for every one of them is so for each. None: the plan reads them from the device."""
    document_kernel: str = "auto"
    """The kernel of whole-sequence document attention with cp = 1 (``model.attention_kernel``: see
    ``meshtron.models.attention_kernels.KERNELS``)."""
    hybrid: HybridGroups | None = None
    """With ``method="hybrid"``: the Ulysses and ring groups of this rank (``hybrid``)."""

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)


def chunk_document_bounds(document_ids: torch.Tensor, cp: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(first, last)``: the document id of each row's first and last token in each of the ``2*cp`` chunks of
    ``document_ids`` (B, S), as lists (what ``SequenceLayout.document_bounds`` holds). On a host tensor no
    device is read."""
    chunk = document_ids.shape[1] // (2 * cp)
    first, last = torch.stack([document_ids[:, ::chunk], document_ids[:, chunk - 1 :: chunk]]).tolist()
    return first, last
