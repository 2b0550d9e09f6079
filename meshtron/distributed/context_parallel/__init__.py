"""Context parallelism and meshtron's attention routing (docs/context-parallel.md).

* ``layout``: the load-balanced split of a sequence over the ``cp`` ranks and ``SequenceLayout``.
* ``ring``: ``context_parallel_attention``, the ring / all-gather exchange of K/V and its autograd.
* ``tiles``: which tiles of the attention matrix, (query chunk, key chunk) pairs, to compute and their masks,
  planned once per micro-batch.
* ``tile_kernels``, ``fused_tile_kernels``: attention on one tile, returning the log-sum-exp.
* ``ulysses``: ``ulysses_attention`` (``parallel.cp_method=ulysses``), all-to-all from sequence shards to head
  shards around whole-sequence attention.
* ``hybrid``: ``hybrid_attention`` (``parallel.cp_method=hybrid``), Ulysses inside groups of ``cp_ulysses``
  consecutive cp ranks, the ring across the groups.
* ``routing``: ``hf_attention``, the attention function transformers calls, and its registration.
"""

from meshtron.distributed.context_parallel.hybrid import hybrid_attention, hybrid_groups
from meshtron.distributed.context_parallel.layout import (
    HybridGroups,
    SequenceLayout,
    check_context_parallel,
    chunk_document_bounds,
    local_token_index,
    shard_sequence,
)
from meshtron.distributed.context_parallel.ring import context_parallel_attention
from meshtron.distributed.context_parallel.routing import ATTENTION_NAME, hf_attention, register_attention
from meshtron.distributed.context_parallel.tiles import planned_tiles
from meshtron.distributed.context_parallel.ulysses import check_ulysses, ulysses_attention

__all__ = [
    "ATTENTION_NAME",
    "HybridGroups",
    "SequenceLayout",
    "check_context_parallel",
    "chunk_document_bounds",
    "check_ulysses",
    "context_parallel_attention",
    "hf_attention",
    "hybrid_attention",
    "hybrid_groups",
    "local_token_index",
    "planned_tiles",
    "register_attention",
    "shard_sequence",
    "ulysses_attention",
]
