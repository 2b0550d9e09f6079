"""Start-up of tied embeddings under pipeline parallelism (meshtron.distributed.tied_embeddings): the process groups
that sum the embedding and head gradients. In one process on torch's fake backend (a rank of a 4-rank world); the
gradient sums themselves are checked against one process by the tied PP layouts of test_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import ParallelConfig
from meshtron.distributed import tied_embeddings
from meshtron.distributed.mesh import Meshes
from meshtron.distributed.pipeline_parallel import TIED_WEIGHTS


@pytest.fixture
def fake_world():
    """Rank 0 of a fake 4-rank world: pp=2 x tp=2, so the tied pairs are (0, 2) and (1, 3)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _first_stage() -> nn.Module:
    stage = nn.Module()
    stage.embed_tokens = nn.Embedding(8, 4)
    setattr(stage, TIED_WEIGHTS, {"lm_head.weight": "embed_tokens.weight"})
    return stage


@pytest.mark.parametrize("splits", [True, False])
def test_one_world_wide_call_creates_every_tied_pair(fake_world, monkeypatch, splits):
    """Where the backend can split (NCCL bound to a GPU) one split_group creates all the pairs (before: one world-wide
    new_group per pair, tp x dp x cp of them); on gloo one new_group per pair, as before."""
    calls = {"new_group": [], "split_group": []}
    pair = dist.new_group([0, 2])
    real_new_group = dist.new_group

    def new_group(ranks, *args, **kwargs):
        calls["new_group"].append(list(ranks))
        return real_new_group(ranks, *args, **kwargs)

    def split_group(split_ranks, **kwargs):
        calls["split_group"].append(split_ranks)
        return pair

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "split_group", split_group, raising=False)
    monkeypatch.setattr(tied_embeddings, "can_split_groups", lambda: splits)
    world = type("Mesh", (), {"mesh": torch.arange(4).view(2, 1, 1, 1, 2)})()  # only its rank grid is read
    meshes = Meshes(world=world, dp=None, dp_shard_cp=None, dp_cp=None, fsdp=None)
    sync = tied_embeddings.tied_embedding_sync([_first_stage()], [0], ParallelConfig(pp=2, tp=2), meshes)
    assert sync is not None and len(sync.embeddings) == 1 and not sync.heads
    if splits:
        assert calls == {"new_group": [], "split_group": [[[0, 2], [1, 3]]]}
        assert sync.group is pair
    else:
        assert calls == {"new_group": [[0, 2], [1, 3]], "split_group": []}
        assert dist.get_world_size(sync.group) == 2


def test_split_groups_only_where_the_default_group_is_bound_to_a_device(fake_world):
    """gloo / the fake backend (no bound device): no split_group, the new_group path."""
    assert not tied_embeddings.can_split_groups()
