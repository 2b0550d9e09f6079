"""ParallelDims: the degrees of every parallelism, checked against the world size, and the named mesh."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from meshtron.config import ParallelConfig, ParallelOptions
from meshtron.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def is_fake_group(group) -> bool:
    """Whether ``group`` is PyTorch's fake process group (a rehearsal, meshtron.plan.rehearsal): its collectives
    return at once and deliver nothing."""
    import torch.distributed as dist

    return dist.get_backend(group) == "fake"


@dataclass(frozen=True)
class Meshes:
    """The meshes of a run (``ParallelDims.build_mesh``): the 5-D ``world`` mesh, its flattened groupings, the mesh
    FSDP shards over and, under expert parallelism, the expert meshes (:func:`expert_meshes`; None
    without EP)."""

    world: DeviceMesh
    """The 5-D mesh, dims ``MESH_DIMS``; ``pp``, ``tp``, ``cp`` below are its 1-D slices."""
    dp: DeviceMesh
    """``(dp_replicate, dp_shard)`` flattened: the data-parallel ranks."""
    dp_shard_cp: DeviceMesh
    """``(dp_shard, cp)`` flattened: the ranks FSDP shards over (without HSDP)."""
    dp_cp: DeviceMesh
    """``(dp_replicate, dp_shard, cp)`` flattened: the ranks a loss or router statistic is summed over."""
    fsdp: DeviceMesh
    """The mesh FSDP shards over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
    ep: DeviceMesh | None = None
    """The 1-D mesh the experts are sharded over (expert parallelism)."""
    efsdp: DeviceMesh | None = None
    """The ranks of ``dp_shard x cp`` that hold the same experts."""
    expert_fsdp: DeviceMesh | None = None
    """The mesh FSDP shards expert parameters over: ``efsdp``, or ``(dp_replicate, efsdp)`` for HSDP."""

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees, the one description of them: ``ParallelConfig`` (what the user writes, ``dp_shard`` may be
    -1) becomes one through ``from_config`` and, with its ``ParallelOptions``, goes back through ``to_config``; the
    planner's ``Layout`` and ``meshtron check``'s catalogue hold one. Their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel degree, borrowed from ``dp_shard x cp`` (not a mesh dimension of its own)."""

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        fixed = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate*cp*tp*pp = {fixed}; "
                    "change the degrees or the number of processes"
                )
            dp_shard = world_size // fixed
        dims = cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep)
        if dims.product != world_size:
            raise ConfigError(
                f"world size {world_size} != product of the parallel degrees "
                f"(pp {dims.pp} x dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp} "
                f"x tp {dims.tp} = {dims.product}); launch {dims.product} processes or change parallel.*"
            )
        if dims.ep > 1 and (dims.dp_shard * dims.cp) % dims.ep:
            raise ConfigError(
                f"parallel.ep={dims.ep} must divide parallel.dp_shard*cp = {dims.dp_shard * dims.cp} (expert "
                "parallelism "
                "borrows its ranks from the data-parallel shard and context-parallel ranks); change parallel.ep or "
                "parallel.dp_shard"
            )
        return dims

    def to_config(self, options: ParallelOptions = ParallelOptions()) -> ParallelConfig:
        """These degrees and ``options`` (``sequence_parallel``, ``cp_method``, ``pp_schedule`` ...) as the
        ``[parallel]`` section a run uses."""
        return ParallelConfig(**asdict(self), **asdict(options))

    @property
    def product(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def world_size(self) -> int:
        return self.product

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over ``dp_shard x cp``: context-parallel ranks hold the same parameters too."""
        return self.dp * self.cp > 1

    def fsdp_applied(self, cpu_offload: bool) -> bool:
        """Whether the model is sharded with ``fully_shard``: over ``dp_shard x cp`` ranks (``fsdp_enabled``), or, for
        ``fsdp.cpu_offload`` in a world of one, over a one-rank mesh, so that FSDP2's CPUOffloadPolicy keeps the
        parameters, gradients and optimizer state of a single GPU in host memory too."""
        return self.fsdp_enabled or (cpu_offload and self.product == 1)

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def build_mesh(self, device_type: str) -> Meshes:
        """The named meshes (:class:`Meshes`): the 5-D mesh, the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp``
        meshes, ``fsdp`` and, under expert parallelism, the expert meshes.

        Flattened meshes are kept here rather than sliced from the root later, which PyTorch deprecates.
        """
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = init_device_mesh(device_type, self.shape(), mesh_dim_names=MESH_DIMS)
        dp_shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes = Meshes(
            world=mesh,
            dp=mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            dp_shard_cp=dp_shard_cp,
            dp_cp=mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
            fsdp=DeviceMesh._concatenate([mesh["dp_replicate"], dp_shard_cp]) if self.dp_replicate > 1 else dp_shard_cp,
        )
        if self.ep > 1:  # ep, efsdp and expert_fsdp, split from dp_shard_cp
            meshes = expert_meshes(meshes, self.ep)
        return meshes

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in (*MESH_DIMS, "ep") if getattr(self, name) > 1]
        return " ".join(parts) or "single process"


def expert_meshes(meshes: Meshes, ep: int) -> Meshes:
    """``meshes`` with the expert-parallel meshes, borrowed from ``dp_shard x cp``.

    ``meshes``: what ``ParallelDims.build_mesh`` returns (its ``world`` and ``dp_shard_cp`` are used). The
    flattened ``dp_shard_cp`` dim (size ``dp_shard * cp``) is split into ``(efsdp, ep)``, ``ep``
    innermost, so an EP group is ``ep`` consecutive ranks of ``dp_shard_cp`` (on GPUs: inside a node
    when ``ep`` <= GPUs per node and tp == 1). Sets:

    - ``ep``: the 1-D mesh the experts are sharded over (:func:`apply_expert_parallel`);
    - ``efsdp``: the 1-D mesh of the ranks that hold the *same* experts within ``dp_shard x cp``;
    - ``expert_fsdp``: the mesh FSDP shards the expert parameters over: ``efsdp``, or
      ``(dp_replicate, efsdp)`` for HSDP (as ``fsdp`` is for the dense parameters).

    Every tp rank of a group sees the same tokens, so ``ep`` is not borrowed from ``tp``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    world = meshes.world
    names = world.mesh_dim_names
    dp_shard_cp = meshes.dp_shard_cp
    size = dp_shard_cp.size()
    if ep < 1 or size % ep:
        raise ConfigError(
            f"parallel.ep={ep} must divide parallel.dp_shard*cp = {size} (expert parallelism borrows its ranks "
            "from the data-parallel shard and context-parallel ranks); change parallel.ep or parallel.dp_shard"
        )
    sparse = dp_shard_cp._unflatten(0, (size // ep, ep), ("efsdp", "ep"))
    efsdp = sparse["efsdp"]
    if "dp_replicate" in names and world.size(names.index("dp_replicate")) > 1:
        expert_fsdp = DeviceMesh._concatenate([world["dp_replicate"], efsdp])
    else:
        expert_fsdp = efsdp
    return replace(meshes, ep=sparse["ep"], efsdp=efsdp, expert_fsdp=expert_fsdp)
