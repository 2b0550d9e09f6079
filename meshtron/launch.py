"""Starting a run's workers from ``meshtron train|eval --nproc N``: torch's elastic launcher (torchrun), in this
process, on this machine or on each node of a multi-node job (``meshtron.cluster`` says which nodes).

Everything is checked once here, before any worker starts: enough processes for the parallel degrees, the config
(preflight), a run directory every worker shares. Under ``torchrun`` (or with one process) ``meshtron.cli`` trains
without coming here.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime
from pathlib import Path

from meshtron.errors import ConfigError


def processes_needed(p) -> int:
    """The product of the configured parallel degrees (an unset dp_shard, -1, counted as 1)."""
    return p.dp_replicate * max(p.dp_shard, 1) * p.tp * p.cp * p.pp


def nodes_of(args: argparse.Namespace):
    """The machines of a multi-node launch: the command line's, or SLURM's under srun; None on one machine."""
    from meshtron.cluster import command_line_nodes, slurm_nodes

    return command_line_nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id) or (
        slurm_nodes(os.environ, args.master_port) if args.nnodes is None else None
    )


def check_enough_processes(cfg, world_size: int, explicit: bool) -> None:
    needed = processes_needed(cfg.parallel)
    if not explicit and needed > world_size:
        raise ConfigError(
            f"the parallel degrees need {needed} processes but meshtron was started as 1; "
            f"add --nproc {needed} or launch with torchrun --nproc-per-node {needed}"
        )


def self_launch(args, extra: list[str], cfg, world_size: int, nodes=None, command=("train",)) -> int:
    """Check everything once here, then start ``world_size`` workers with torch's elastic launcher, each running
    ``meshtron <command> ...`` with the same settings.

    Exit status: 0, the first failed worker's (e.g. 124 after a hang), or 75 when a signal stopped the
    run after its checkpoint was saved (docs/faults.md)."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from meshtron.distributed.devices import resolve_device_type
    from meshtron.resilience.launcher_signals import forward_stop_signals, stopped_with_checkpoint
    from meshtron.train.preflight import preflight

    preflight(cfg, world_size, resolve_device_type(cfg.run.device, world_size))
    if cfg.run.output_dir is None:
        if nodes is not None and not nodes.job_id.startswith("slurm-"):
            raise ConfigError(
                "a launch over several nodes needs run.output_dir: a folder every node shares (each "
                "machine would pick its own runs/<timestamp>)"
            )
        name = nodes.job_id if nodes is not None else datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run.output_dir = str(Path("runs") / name)
        extra = [*extra, f"--run.output_dir={cfg.run.output_dir}"]
    launcher_args = ["--nnodes=1", f"--nproc-per-node={world_size}", f"--max-restarts={args.max_restarts}"]
    if nodes is not None:
        launcher_args = nodes.launcher_args(args.nproc) + [f"--max-restarts={args.max_restarts}"]
    elif args.master_port:
        launcher_args += ["--master-addr=127.0.0.1", f"--master-port={args.master_port}"]
    else:
        launcher_args += ["--standalone"]
    # torchrun sets OMP_NUM_THREADS=1 when it is unset and prints a banner saying so; set it here (the cores shared
    # by this machine's workers) so that neither happens. A value the user set is kept.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (args.nproc or world_size))))
    parser = get_args_parser()
    worker = ["-m", "meshtron", *command] + (["--config", args.config] if args.config else []) + extra
    started = time.time()
    with forward_stop_signals(parser, launcher_args, cfg.run.collective_timeout_s) as stopped:
        try:
            run(parser.parse_args(launcher_args + worker))
        except ChildFailedError as err:
            _, failure = err.get_first_failure()
            return failure.exitcode if failure.exitcode > 0 else 1
        except stopped.exception as err:
            return stopped_with_checkpoint(cfg, started, err.sigval)
    return 0
