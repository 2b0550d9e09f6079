"""Starting a run's workers from ``meshtron train|eval --nproc N``: torch's elastic launcher (torchrun), in this
process, on this machine or on each node of a multi-node job (``meshtron.cluster`` says which nodes).

Everything is checked once here, before any worker starts: enough processes for the parallel degrees, the config
(preflight), a run directory every worker shares. Under ``torchrun`` (or with one process) ``meshtron.cli`` trains
without coming here.

The workers are forked from a forkserver (multiprocessing's: a process started once, before any worker, that
imports torch, transformers and the training loop; meshtron.launch_preload): a worker starts without ~5 s of CPU of
imports of its own, and a restart after a failure re-imports nothing. ``--rank-start fresh`` starts each worker as
a new ``python -m meshtron`` instead, as torchrun does.
"""

from __future__ import annotations

import argparse
import os
import sys
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
    from torch.distributed.run import get_args_parser

    from meshtron.distributed.devices import resolve_device_type
    from meshtron.resilience.faults import LAUNCHER_PID_ENV
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
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # for fault injection: a worker's parent is the forkserver
    parser = get_args_parser()
    worker = [*command] + (["--config", args.config] if args.config else []) + extra
    started = time.time()
    with forward_stop_signals(parser, launcher_args, cfg.run.collective_timeout_s) as stopped:
        try:
            launcher = parser.parse_args(launcher_args + ["-m", "meshtron", *worker])
            start_workers(launcher, worker, args.rank_start or RANK_STARTS[0])
        except ChildFailedError as err:
            _, failure = err.get_first_failure()
            return failure.exitcode if failure.exitcode > 0 else 1
        except stopped.exception as err:
            return stopped_with_checkpoint(cfg, started, err.sigval)
    return 0


RANK_STARTS = ("forkserver", "fresh")
"""How ``--nproc`` starts each worker: forked from meshtron's forkserver (the default), or as a fresh interpreter."""
FORKSERVER_IGNORED_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""Stop signals the forkserver ignores (meshtron.launch_preload) and each worker handles again (SIGINT: the forkserver
ignores it itself and gives its workers Python's handler back)."""


def start_workers(launcher: argparse.Namespace, worker_argv: list[str], rank_start: str) -> None:
    """Run torch's elastic agent with ``launcher`` (torchrun's parsed arguments, which name ``meshtron`` as the module
    to run) until the workers end; each worker runs ``meshtron WORKER_ARGV``. Raises ChildFailedError as torchrun's
    ``run`` does."""
    from torch.distributed.run import config_from_args, run

    if rank_start == "fresh":
        run(launcher)
        return
    import multiprocessing

    from torch.distributed.launcher.api import elastic_launch

    _rendezvous_as_torchrun(launcher)
    _log_worker_failures_without_traceback()
    config, _, _ = config_from_args(launcher)
    config.start_method = "forkserver"
    multiprocessing.set_forkserver_preload(["meshtron.launch_preload"])
    elastic_launch(config, entrypoint=run_forked_rank)(worker_argv)


def _log_worker_failures_without_traceback() -> None:
    """Keep the elastic agent's one-line "failed (exitcode: N) local_rank: R" report of a forked worker but drop the
    launcher-side traceback it attaches (torch.multiprocessing's ProcessExitedException, which says nothing the line
    does not). Formatting it through torch's log formatter imports torch._dynamo: seconds of CPU in the launcher,
    between a worker's failure and the others being stopped."""
    import logging

    def without_traceback(record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(without_traceback)


def _rendezvous_as_torchrun(launcher: argparse.Namespace) -> None:
    """What ``torch.distributed.run.run`` settles before it builds the launch config (a one-machine rendezvous on a
    free port), which ``config_from_args`` leaves to it."""
    import uuid

    from torch.distributed.run import parse_min_max_nnodes

    one_machine = launcher.rdzv_backend == "static" and not launcher.rdzv_endpoint and launcher.master_port is None
    if launcher.standalone or (one_machine and parse_min_max_nnodes(launcher.nnodes)[1] == 1):
        launcher.rdzv_backend, launcher.rdzv_endpoint, launcher.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if launcher.master_port is None:
        launcher.master_port = 29500


def run_forked_rank(argv: list[str]) -> None:
    """A worker of ``start_workers``, in a process forked from the forkserver: ``meshtron ARGV`` as ``python -u -m
    meshtron ARGV`` runs it under torchrun. Returns on success (torch's agent waits for the return value); any other
    end leaves with its exit status, a traceback first where one was raised."""
    import logging
    import signal
    import traceback

    from meshtron.cli import main

    for name in FORKSERVER_IGNORED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # as python -u: lines out as they are written
    try:
        code = main(argv)
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    if code:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
