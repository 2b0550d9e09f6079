"""Runs training layouts one after another on processes forked from this one.

Usage: python tests/parity_worker.py SPEC.json OUT_DIR
SPEC.json: {"base": [overrides...], "layouts": {name: [overrides...]}, "worlds": {name: processes}}; an override
``env:VAR=VALUE`` sets an environment variable for that layout only (e.g. ``env:MESHTRON_FAULT=nan:step=6``).
For each layout, rank 0 writes OUT_DIR/<name>.json (per-step losses and grad norms, [step, loss] of each
evaluation, the largest parameter +
gradient + optimizer bytes of any rank, the largest activation peak and the largest gradient bytes held between
accumulated micro-batches) and OUT_DIR/<name>.pt (full final weights). Layouts run in order (a later one may
resume from an earlier one's checkpoint); the first that fails ends the launch with its name and exit codes.

Why forks rather than one torchrun launch: the imports (transformers' is ~5 s of CPU) happen once, here.

Consecutive layouts of one world size share their processes (``shared_runs``): each joins the process group
once and trains its layouts in turn. Half of a small tensor-parallel layout's CPU is DTensor's sharding propagation
of the ops it meets first, which torch caches per process keyed by the device mesh and the shapes; the layouts after
the first find much of it cached (the 2-process layouts took 45 s instead of 100 s). Device meshes of a later layout
reuse the process groups made for the same ranks by an earlier one (``reuse_mesh_groups``): one new set of gloo
groups per layout, each polling ~100 times a second while idle, made a process that ran 48 layouts spend more CPU
in wakeups than in training. No group is destroyed before the run ends: the cached propagation results name the
meshes (and so the groups) of the layout that met them first. A layout's ``env:`` overrides (fault injection) are
set while it runs and removed after it. A layout that compiles runs on fresh processes of its own; a failure in a
shared run names the layout that failed.
"""

import gc
import json
import multiprocessing
import os
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from conftest import free_port
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtron.config import load_config
from meshtron.metrics.memory import local_bytes
from meshtron.resilience.process_group import init_runtime, shutdown_runtime
from meshtron.train.setup.preflight import preflight
from meshtron.train.trainer import train


def expert_state_bytes(result) -> tuple[torch.Tensor, int]:
    """(bytes this rank holds of the experts' parameters and AdamW state, bytes of all of it unsharded) after the
    run: the local shards of every ``.experts.`` parameter and of its optimizer state, against their full sizes."""
    local = full = 0
    for part in result.model_parts:
        for name, param in part.named_parameters():
            if ".experts." not in name:
                continue
            tensors = [param] + [
                v for v in result.optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0
            ]
            local += sum(local_bytes(t) for t in tensors)
            full += len(tensors) * param.numel() * param.element_size()
    return torch.tensor([local], dtype=torch.int64), full


def run_rank(rank: int, world: int, port: int, names: list[str], spec: dict, out: Path) -> None:
    """One rank of a run of layouts, in a forked process: join the process group, train each layout in turn (its
    ``env:`` overrides set for it alone), write the results."""
    set_rank_environment(rank, world, port)
    reuse_mesh_groups()
    name = names[0]
    try:
        runtime = init_runtime()
        try:
            for name in names:
                started = time.perf_counter()
                env = layout_env(spec["layouts"][name])
                overrides = [item for item in spec["layouts"][name] if not item.startswith("env:")]
                with mock.patch.dict(os.environ, env):  # this layout's env: overrides, for it alone
                    cfg = load_config(None, spec["base"] + overrides + [f"run.output_dir={out / name}"], env={})
                    train_and_record(name, cfg, runtime, out)
                if runtime.is_main:
                    print(f"layout {name}: {world} processes, {time.perf_counter() - started:.1f} s", flush=True)
        finally:
            shutdown_runtime()
    except BaseException:
        print(f"[rank{rank}] layout {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)


def reuse_mesh_groups() -> None:
    """Make device meshes reuse the process group of a set of ranks made for an earlier layout of this run, instead
    of a new one per mesh dimension per layout. Each gloo group keeps threads that wake ~100 times a second even when
    idle (the transport's event loop polls with a 10 ms timeout): with new groups for every layout, a process that
    ran 48 layouts spent more CPU in those wakeups than in training. Every rank makes the same calls in the same order,
    so every rank reuses the same groups; collectives of one layout run in turn, so a group serving two mesh
    dimensions (or two layouts) is used as two groups would be."""
    import torch.distributed.device_mesh as device_mesh

    made = {}
    new_group = device_mesh.new_group

    def reused(ranks=None, timeout=None, backend=None, **kwargs):
        key = (tuple(ranks) if ranks is not None else None, timeout, backend)
        if key not in made:
            made[key] = new_group(ranks=ranks, timeout=timeout, backend=backend, **kwargs)
        return made[key]

    device_mesh.new_group = reused


def set_rank_environment(rank: int, world: int, port: int) -> None:
    """The variables torchrun gives each worker, for a rank of ``world`` on this machine rendezvousing at ``port``."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def layout_env(overrides: list[str]) -> dict[str, str]:
    return dict(item[len("env:") :].split("=", 1) for item in overrides if item.startswith("env:"))


def shared_runs(spec: dict) -> list[list[str]]:
    """The layouts in order, cut into runs that share processes: consecutive layouts of one world size; a layout
    with ``train.compile=true`` alone (compiled code and dynamo's caches stay behind in a process)."""
    runs: list[list[str]] = []
    shareable = False  # whether the last run may take the next layout
    for name, overrides in spec["layouts"].items():
        alone = "train.compile=true" in overrides
        world = spec["worlds"][name]
        if shareable and not alone and spec["worlds"][runs[-1][0]] == world:
            runs[-1].append(name)
        else:
            runs.append([name])
        shareable = not alone
    return runs


def train_and_record(name: str, cfg, runtime, out: Path) -> None:
    setup = preflight(cfg, runtime.world_size, runtime.device.type)
    result = train(cfg, runtime, setup)
    measured = torch.tensor(
        [
            sum(result.state_bytes.values()),
            result.activation_bytes,
            result.accumulation_grad_bytes,
            result.offloaded_bytes,
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    expert_local, expert_full = expert_state_bytes(result)
    dist.all_reduce(expert_local, op=dist.ReduceOp.MAX)
    options = StateDictOptions(full_state_dict=True)  # on every rank (cpu_offload would keep it on rank 0 only)
    state = {}
    for part in result.model_parts:  # pipeline stages: each holds some of the parameters, names unchanged
        state.update(get_model_state_dict(part, options=options))
    if setup.dims.pp > 1:
        pieces = [None] * runtime.world_size
        dist.all_gather_object(pieces, state)
        state = {key: tensor for piece in pieces for key, tensor in piece.items()}
    if runtime.is_main:
        torch.save(state, out / f"{name}.pt")
        (out / f"{name}.json").write_text(
            json.dumps(
                {
                    "losses": result.losses,
                    "grad_norms": result.grad_norms,
                    "eval_losses": result.eval_losses,
                    "state_bytes": int(measured[0]),
                    "activation_bytes": int(measured[1]),
                    "accumulation_grad_bytes": int(measured[2]),
                    "offloaded_bytes": int(measured[3]),
                    "expert_state_bytes": [int(expert_local), expert_full],
                }
            )
        )


def run_layouts(context, world: int, names: list[str], spec: dict, out: Path) -> None:
    """Fork the ranks that train ``names`` in turn and wait for them; the first rank that fails (or the timeout)
    stops them all."""

    def target(rank: int, port: int) -> None:
        run_rank(rank, world, port, names, spec, out)

    label = f"layout {names[0]}" if len(names) == 1 else f"layouts {names[0]} .. {names[-1]} ({len(names)})"
    fork_ranks(context, world, target, label, spec.get("timeout_s", 600) * len(names))


def fork_ranks(context, world: int, target, name: str, timeout_s: float) -> None:
    """Run ``target(rank, port)`` on ``world`` processes forked from this one (``port``: a free rendezvous port for
    MASTER_PORT) and wait for them; the first that fails (or the timeout) stops them all and ends this process with
    ``name`` and the exit codes."""
    port = free_port()
    ranks = [context.Process(target=target, args=(rank, port)) for rank in range(world)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout_s
    running = list(ranks)
    while running:
        wait([process.sentinel for process in running], timeout=max(0.0, deadline - time.monotonic()))
        running = [process for process in ranks if process.exitcode is None]
        failed = [process for process in ranks if process.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for process in running:
                process.kill()
            for process in ranks:
                process.join()
            why = (
                f"timed out after {timeout_s:.0f} s" if not failed else "exit codes " + str([p.exitcode for p in ranks])
            )
            sys.exit(f"{name} on {world} processes failed: {why}")


def import_before_forking() -> None:
    """Import here, once, what every rank would otherwise import again (meshtron check's list: transformers' model
    classes of every family meshtron knows, torch's parallel APIs, the training loop), and torchao's float8 for
    the float8 layouts. Nothing here starts a thread or touches a tensor (a fork keeps neither safely)."""
    import importlib

    from meshtron.train.setup.rank_imports import device_questions_without_cuda, import_rank_modules

    import_rank_modules()
    try:
        with device_questions_without_cuda():
            importlib.import_module("torchao.float8")
    except ImportError:  # float8 layouts need it; the others do not
        pass


def check_cuda_uninitialized() -> None:
    """Leave with one line if CUDA was initialized here: no rank forked from this process could use it."""
    from meshtron.train.setup.rank_imports import cuda_initialized_here

    if cuda_initialized_here():
        sys.exit("CUDA was initialized in the test launcher before forking its ranks (an import asked the device)")


def main() -> None:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    import_before_forking()
    # Every object imported so far moves to a generation the collector never scans: a forked rank's collections then
    # do not write into the pages it shares with this process (copy-on-write), which measured ~10% of a launch's CPU.
    gc.freeze()
    check_cuda_uninitialized()
    context = multiprocessing.get_context("fork")
    for names in shared_runs(spec):
        run_layouts(context, spec["worlds"][names[0]], names, spec, out)


if __name__ == "__main__":
    main()
