"""The named meshes (meshtron.distributed.mesh.Meshes) of ParallelDims.build_mesh, built in one process as rank 0 of
a fake 8-rank world: each name is the mesh of the ranks it says (rank = dp_replicate*4 + dp_shard*2 + cp)."""

from __future__ import annotations

import pytest

from meshtron.distributed.mesh import MESH_DIMS, Meshes, ParallelDims
from meshtron.distributed.one_rank_group import one_rank_group


@pytest.fixture
def fake_world():
    with one_rank_group(0, 8):
        yield


def test_each_named_mesh_holds_the_ranks_its_name_says(fake_world):
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, ep=2)
    meshes = dims.build_mesh("cpu")
    assert isinstance(meshes, Meshes) and meshes.world.device_type == "cpu"
    assert meshes.world.mesh_dim_names == MESH_DIMS and tuple(meshes.world.shape) == dims.shape()
    for name in ("pp", "cp", "tp"):
        assert getattr(meshes, name).mesh_dim_names == (name,)
    ranks = {
        name: getattr(meshes, name).mesh.flatten().tolist()
        for name in ("pp", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "fsdp", "ep", "efsdp", "expert_fsdp")
    }
    assert ranks == {
        "pp": [0],
        "tp": [0],
        "cp": [0, 1],
        "dp": [0, 2, 4, 6],  # dp_replicate x dp_shard: the ranks that read different batches
        "dp_shard_cp": [0, 1, 2, 3],
        "dp_cp": list(range(8)),
        "fsdp": [0, 1, 2, 3, 4, 5, 6, 7],  # HSDP: (dp_replicate, dp_shard_cp)
        "ep": [0, 1],  # ep innermost in dp_shard_cp
        "efsdp": [0, 2],
        "expert_fsdp": [0, 2, 4, 6],  # HSDP: (dp_replicate, efsdp)
    }
    assert meshes.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert meshes.expert_fsdp.mesh_dim_names == ("dp_replicate", "efsdp")


def test_without_ep_or_replicas_fsdp_is_dp_shard_cp_and_no_expert_mesh(fake_world):
    meshes = ParallelDims(dp_shard=4, tp=2).build_mesh("cpu")
    assert meshes.fsdp is meshes.dp_shard_cp and meshes.fsdp.mesh.tolist() == [0, 2, 4, 6]
    assert meshes.tp.mesh.tolist() == [0, 1]
    assert (meshes.ep, meshes.efsdp, meshes.expert_fsdp) == (None, None, None)
