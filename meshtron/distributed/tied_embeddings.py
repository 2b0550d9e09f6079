"""Tied embeddings under pipeline parallelism, Megatron-style.

A model that ties its head to its embeddings (``lm_head.weight is model.embed_tokens.weight``) cannot share
one parameter between its first pipeline stage (the embeddings) and its last (the head). The last stage
holds the head as a parameter of its own (see ``pipeline_parallel.split_pipeline``), initialized (or loaded)
with the embeddings' values. After each step's backward the two gradients are summed: each copy then holds
the gradient of the single tied weight, the optimizer updates both identically and they stay equal.

The sum is an all-reduce over a group of two ranks, the pipeline rank holding the first stage and the one holding
the last, for each (dp_replicate, dp_shard, cp, tp) coordinate; when one rank holds both stages (ZBV's V shape) it
is a local addition. All the pairs come from one ``split_group`` of the world where the backend can split (NCCL
bound to the GPU: one communicator split), else from one ``new_group`` each (gloo). Both parameters have the same
placements (vocabulary rows split by TP's row-wise embedding and column-wise head, then by FSDP on dim 0), so the
local shards line up; it runs after FSDP reduced the gradients. The head copy is marked ``DUPLICATE_GRADIENT`` so
that the gradient norm counts the tied weight once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import ParallelConfig
from meshtron.distributed.grad_norm import DUPLICATE_GRADIENT
from meshtron.distributed.mesh import Meshes
from meshtron.distributed.pipeline_parallel import TIED_WEIGHTS, local_stage_ids, stages_per_rank
from meshtron.distributed.tensor_parallel import reduce_partial_gradients, shard_replicated_gradients
from meshtron.errors import MeshtronError
from meshtron.models.adapter import canonical_name
from meshtron.tensors import local_tensor


def _named(parts: list[nn.Module], name: str) -> list[nn.Parameter]:
    return [p for part in parts for n, p in part.named_parameters() if canonical_name(n) == name]


class TiedEmbeddingSync:
    """Sums this rank's tied embedding and head gradients with their partners' (call after backward)."""

    def __init__(self, embeddings: list[nn.Parameter], heads: list[nn.Parameter], group):
        self.embeddings, self.heads, self.group = embeddings, heads, group
        for head in heads:
            setattr(head, DUPLICATE_GRADIENT, True)

    @torch.no_grad()
    def __call__(self) -> None:
        params = self.embeddings + self.heads
        if not params:
            return
        for param in params:
            if param.grad is None:  # no gradient reached it: it still takes part in the sum
                param.grad = torch.zeros_like(param)
        # Gradients with the parameters' own placements (TP without FSDP leaves them replicated or partial).
        shard_replicated_gradients(params)
        reduce_partial_gradients(params)
        if self.group is None:  # first and last stage on this rank
            for embedding, head in zip(self.embeddings, self.heads):
                total = local_tensor(embedding.grad) + local_tensor(head.grad)
                local_tensor(embedding.grad).copy_(total)
                local_tensor(head.grad).copy_(total)
            return
        for param in params:
            dist.all_reduce(local_tensor(param.grad), group=self.group)


def _split(param: torch.Tensor) -> tuple:
    """How a parameter is split: its placements, full shape and this rank's local shape."""
    return str(getattr(param, "placements", None)), tuple(param.shape), tuple(local_tensor(param).shape)


def _check_alike(a: tuple, b: tuple) -> None:
    if a != b:
        raise MeshtronError(
            f"tied embeddings and head are split differently under pipeline parallelism ({a} vs {b}); use parallel.pp=1"
        )


def can_split_groups() -> bool:
    """Whether ``torch.distributed.split_group`` can create subgroups here: NCCL bound to this rank's GPU
    (``init_process_group(device_id=...)``, as meshtron starts it on CUDA), the condition torch's DeviceMesh splits
    under. Not gloo: the CPU runs create each group with ``new_group``."""
    default = dist.distributed_c10d._get_default_group()
    if not hasattr(dist, "split_group") or getattr(default, "bound_device_id", None) is None:
        return False
    if not torch.accelerator.is_available():
        return False
    backend = default._get_backend(torch.accelerator.current_accelerator())
    return bool(getattr(backend, "supports_splitting", False))


def pair_groups(pairs: list[tuple[int, int]]):
    """This rank's process group among ``pairs`` (disjoint pairs of global ranks; None when it is in none). Every
    rank must call this. One ``split_group`` of the world for all pairs where the backend can split (one
    communicator split, however many pairs); else one ``new_group`` per pair, every rank creating every group in
    the same order (gloo)."""
    me = dist.get_rank()
    if can_split_groups():
        return dist.split_group(split_ranks=[list(pair) for pair in pairs])
    group = None
    for pair in pairs:
        created = dist.new_group(list(pair))
        if me in pair:
            group = created
    return group


def tied_embedding_sync(
    parts: list[nn.Module], stage_ids: list[int], cfg: ParallelConfig, meshes: Meshes
) -> TiedEmbeddingSync | None:
    """The gradient sum of a tied model's pipeline stages on this rank (None when the model is untied).

    ``parts``: this rank's (parallelized, materialized) stage modules, ``stage_ids`` their stage ids. Every
    rank must call this (it creates process groups).
    """
    names = next((getattr(part, TIED_WEIGHTS) for part in parts if hasattr(part, TIED_WEIGHTS)), None)
    if not names:
        return None
    ((head_name, embedding_name),) = names.items()
    num_stages = cfg.pp * stages_per_rank(cfg)
    first_rank = next(r for r in range(cfg.pp) if 0 in local_stage_ids(r, cfg))
    last_rank = next(r for r in range(cfg.pp) if num_stages - 1 in local_stage_ids(r, cfg))
    embeddings = _named(parts, embedding_name) if 0 in stage_ids else []
    heads = _named(parts, head_name) if num_stages - 1 in stage_ids else []
    if (0 in stage_ids) != bool(embeddings) or (num_stages - 1 in stage_ids) != bool(heads):
        raise MeshtronError(f"pipeline stages: '{embedding_name}' or '{head_name}' not found on their stage")
    group = None
    if first_rank != last_rank:
        ranks = meshes.world.mesh  # (pp, dp_replicate, dp_shard, cp, tp)
        group = pair_groups(list(zip(ranks[first_rank].flatten().tolist(), ranks[last_rank].flatten().tolist())))
    if group is None:
        for embedding, head in zip(embeddings, heads):
            _check_alike(_split(embedding), _split(head))
    else:  # the local shards summed must be the same rows of the same tensor on both ranks
        splits = [None, None]
        dist.all_gather_object(splits, [_split(p) for p in embeddings + heads], group=group)
        for a, b in zip(*splits):
            _check_alike(a, b)
    return TiedEmbeddingSync(embeddings, heads, group)


def attach_tied_embedding_sync(
    runner, parts: list[nn.Module], stage_ids: list[int], cfg: ParallelConfig, meshes: Meshes
):
    """Make the pipeline runner end each step's forward and backward with the tied gradient sum, before the
    gradient norm, clipping and the optimizer; returns the sync (None when the model is untied)."""
    runner.tied_gradients = tied_embedding_sync(parts, stage_ids, cfg, meshes)
    return runner.tied_gradients
