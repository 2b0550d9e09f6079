"""Random numbers of a multi-process run: one seed per pipeline stage, and DTensor's RNG tracker made at start-up.

A random op on a DTensor (dropout on a tensor-parallel activation: ``lora.dropout``, a model's own dropout) draws
through DTensor's RNG tracker, which gives each shard its own part of one random stream, so that ranks holding
the same (replicated) piece draw the same mask. On CUDA, torch makes the tracker at the first such op if none
exists, and then broadcasts rank 0's RNG state over the *world*: a collective that only the ranks reaching that op
join. Under pipeline parallelism stage 0 blocks in it before sending its activations while stage 1 waits for them:
a deadlock in step 1. So the tracker is made here, once, before any forward, without a collective
(``torch.distributed.tensor._random.manual_seed``, as torchtitan does; the same call in torch 2.11 and 2.13).

Seeds: the ranks of one tensor-parallel group get the same one, so that they draw the same masks for replicated
tensors (their generators move in step) and DTensor's tracker gives each shard of a sharded one its own part of
one stream. Every other coordinate draws its own: ``train.seed`` plus the rank's index on the mesh without ``tp``
(pp, dp_replicate, dp_shard, cp), so pipeline stages, and data- and context-parallel ranks (which hold other
tokens), draw independent masks. A single process, or a tp-only layout, keeps ``train.seed``. On CPU meshes DTensor
has no tracker (each rank draws from its own generator, seeded the same way).
"""

from __future__ import annotations

import warnings

import torch

from meshtron.distributed.mesh import Meshes

SEED_MODULUS = 2**63


def rank_seed(seed: int, coordinate: list[int], shape: tuple[int, ...]) -> int:
    """The seed of the rank at ``coordinate`` on the world mesh of ``shape`` (``mesh.MESH_DIMS``, tp last): ``seed``
    plus its index on the mesh without tp, the same for the ranks of one tensor-parallel group."""
    index = 0
    for position, size in zip(coordinate[:-1], shape[:-1]):
        index = index * size + position
    return (seed + index) % SEED_MODULUS


def dtensor_rng_supported(mesh) -> bool:
    """Whether DTensor draws random numbers through its RNG tracker on ``mesh``'s device type (CUDA-like: yes;
    CPU: no), asked without torch's warning for the CPU."""
    from torch.distributed.tensor import _random

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _random.is_rng_supported_mesh(mesh)


def seed_parallel_rng(meshes: Meshes, seed: int) -> int:
    """Seed this rank's generators (``rank_seed``) and make DTensor's RNG tracker, with no collective; call it on
    every rank once the meshes exist, before any forward. Returns the seed."""
    from torch.distributed.tensor import _random

    world = meshes.world
    chosen = rank_seed(seed, world.get_coordinate(), tuple(world.shape))
    torch.manual_seed(chosen)
    if dtensor_rng_supported(world):
        # Makes OffsetBasedRNGTracker(world, run_state_sync=False) if there is none: no broadcast. (A tracker made
        # earlier in this process, by an earlier run, is kept; torch.manual_seed sets the state it draws from.)
        _random.manual_seed(chosen, world)
    return chosen
