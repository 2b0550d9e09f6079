"""Starting a run's workers from ``meshtron train|eval --nproc N``: torch's elastic launcher (torchrun), in this
process, on this machine or on each node of a multi-node job (``meshtron.cluster`` says which nodes).

Everything is checked once here, before any worker starts: enough processes for the parallel degrees, the config
(preflight), a run directory every worker shares. Under ``torchrun`` (or with one process) the train and eval commands
(meshtron.commands) run their rank without coming here. Each worker runs meshtron.worker.

The workers are forked from a forkserver (multiprocessing's: a process started once, before any worker, that
imports torch, transformers and the training loop; meshtron.launch_preload): a worker starts without ~5 s of CPU of
imports of its own, and a restart after a failure re-imports nothing. ``--rank-start fresh`` starts each worker as
a new ``python -m meshtron`` instead, as torchrun does; so does a GPU run whose forkserver has initialized CUDA
anyway (meshtron.train.setup.rank_imports keeps it from doing so; a child forked after it could not use CUDA).

A worker that ends with an error it has said in its own line tells the launcher (``REPORTED_ERRORS_ENV``), which then
leaves out torch's report of that failure: the user sees the one line. A crash keeps torch's report.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import cast

from meshtron.errors import REPORTED_ERRORS_ENV, ConfigError
from meshtron.exits import leave
from meshtron.worker import main as worker_main


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


def self_launch(
    args,
    extra: list[str],
    cfg,
    world_size: int,
    nodes=None,
    command=("train",),
) -> int:
    """Check everything once here, then start ``world_size`` workers with torch's elastic launcher, each running
    ``meshtron <command> ...`` with the same settings (a forked worker: ``meshtron.worker.main`` of that command
    line).

    Exit status: 0, the first failed worker's (e.g. 124 after a hang), or 75 when a signal stopped the
    run after its checkpoint was saved (docs/faults.md)."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser

    from meshtron.checkpoint.earlier_runs import earlier_run_notice
    from meshtron.checkpoint.manager import checkpoint_directory
    from meshtron.config import to_dict
    from meshtron.data.hub import is_hub_id
    from meshtron.distributed.devices import resolve_device_type
    from meshtron.resilience.faults import LAUNCHER_PID_ENV
    from meshtron.resilience.launcher_signals import forward_stop_signals, stopped_with_checkpoint
    from meshtron.resilience.preemption import EXIT_PREEMPTED
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.setup.run_setup import resolved_config

    device_type = resolve_device_type(cfg.run.device, world_size)
    setup = preflight(cfg, world_size, device_type)
    cfg = resolved_config(cfg, setup)  # the model as the workers will load it (their own preflight resolves it again)
    if is_hub_id(cfg.model.name_or_path):  # the commit preflight fetched: every worker loads that snapshot
        extra = [*extra, f"--model.revision={cfg.model.revision}"]
        if setup.revision_notice:  # the workers, given the commit, do not know it was the checkpoint's
            print(setup.revision_notice, flush=True)
    if cfg.run.output_dir is None:
        if nodes is not None and not nodes.job_id.startswith("slurm-"):
            raise ConfigError(
                "a launch over several nodes needs run.output_dir: a folder every node shares (each "
                "machine would pick its own runs/<timestamp>)"
            )
        notice = earlier_run_notice(to_dict(cfg)) if nodes is None else None
        if notice:
            print(notice, flush=True)
        name = nodes.job_id if nodes is not None else datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg = replace(cfg, run=replace(cfg.run, output_dir=str(Path("runs") / name)))
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
    with forward_stop_signals(parser, launcher_args, cfg.run.collective_timeout_s) as stopped, reported_errors_kept():
        try:
            launcher = parser.parse_args(launcher_args + ["-m", "meshtron", *worker])
            start_workers(launcher, worker, args.rank_start or RANK_STARTS[0], device_type)
        except ChildFailedError as err:
            _, failure = err.get_first_failure()
            return failure.exitcode if failure.exitcode > 0 else 1
        except stopped.exception as err:
            code = stopped_with_checkpoint(
                checkpoint_directory(cfg.checkpoint, cfg.run.output_dir), started, err.sigval
            )
            if code != EXIT_PREEMPTED:  # else rank 0 said which checkpoint it saved
                print(unsaved_stop_line(err.sigval, stopped.at_once, code, command[0]), file=sys.stderr, flush=True)
            return code
    return 0


def unsaved_stop_line(received: int, at_once: bool, code: int, command: str = "train") -> str:
    """What the launcher says when a signal stopped ``meshtron COMMAND`` before the workers saved a checkpoint of the
    stop (``meshtron eval`` saves none)."""
    import signal

    name = signal.Signals(received).name
    if command != "train":
        return f"meshtron: {command} stopped by {name} (exit status {code})"
    how = f"stopped at once by a second {name}" if at_once else f"stopped by {name} before the workers could save"
    return (
        f"meshtron: {how}: no checkpoint of this stop; the same command resumes from the last complete "
        f"checkpoint (exit status {code})"
    )


RANK_STARTS = ("forkserver", "fresh")
"""How ``--nproc`` starts each worker: forked from meshtron's forkserver (the default), or as a fresh interpreter."""
FORKSERVER_IGNORED_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")
"""Stop signals the forkserver ignores (meshtron.launch_preload) and each worker handles again (SIGINT: the forkserver
ignores it itself and gives its workers Python's handler back)."""


FORKSERVER_PRELOAD = ["meshtron.launch_preload"]
"""What the forkserver imports before it forks any worker."""


def start_workers(
    launcher: argparse.Namespace,
    worker_argv: list[str],
    rank_start: str,
    device_type: str = "cpu",
) -> None:
    """Run torch's elastic agent with ``launcher`` (torchrun's parsed arguments, which name ``meshtron`` as the module
    to run) until the workers end; each worker runs ``meshtron WORKER_ARGV`` (a forked one calls
    ``meshtron.worker.main(WORKER_ARGV)``). Raises ChildFailedError as torchrun's ``run`` does."""
    from torch.distributed.run import config_from_args, run

    if rank_start_for(rank_start, device_type) == "fresh":
        run(launcher)
        return
    from torch.distributed.launcher.api import elastic_launch

    _rendezvous_as_torchrun(launcher)
    _log_worker_failures_without_traceback()
    config, _, _ = config_from_args(launcher)
    config.start_method = "forkserver"
    elastic_launch(config, entrypoint=run_forked_rank)(worker_argv, device_type)


def rank_start_for(rank_start: str, device_type: str, context=None) -> str:
    """``rank_start``, or ``fresh`` (with one line saying why) for a GPU run whose forkserver (``context``'s, started
    here with ``FORKSERVER_PRELOAD`` unless given) has initialized CUDA, which no child forked from it could use."""
    if rank_start != "forkserver":
        return rank_start
    if context is None:
        import multiprocessing

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    from meshtron.train.setup.rank_imports import initialized_cuda_before_forking

    if device_type != "cuda" or not initialized_cuda_before_forking(context):
        return rank_start
    print(
        "meshtron: CUDA was initialized in the forkserver while it imported the ranks' modules (a child forked from "
        "it could not use CUDA): starting each worker fresh instead (--rank-start fresh)",
        file=sys.stderr,
        flush=True,
    )
    return "fresh"


AGENT_PROCESSES_LOGGER = "torch.distributed.elastic.multiprocessing.api"
TORCH_TEARDOWN_LINES = ("Terminating process", "Sending process", "Closing process")
"""The beginnings of torch's lines about stopping the other workers after one failed (torch.multiprocessing's and
torch.distributed.elastic's)."""


class _ReportedFailures(logging.Filter):
    """Drops torch's report of a worker failure that the worker has said itself (``note_reported_end``): its
    "failed (exitcode: N)" line and the lines about stopping the other workers. Other failures keep them."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode"):
            args = record.args if isinstance(record.args, tuple) else ()
            reported = len(args) > 2 and (self.directory / str(args[2])).exists()
            for note in self.directory.iterdir():  # one report per failure: a restarted attempt starts afresh
                note.unlink(missing_ok=True)
            return not reported
        if message.startswith(TORCH_TEARDOWN_LINES):
            return not any(self.directory.iterdir())
        return True


@contextlib.contextmanager
def reported_errors_kept():
    """Within: workers can say that they reported their own end (``REPORTED_ERRORS_ENV``), and torch's agent and
    torch.multiprocessing then leave out their lines about that failure."""
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="meshtron-reported-"))
    quiet = _ReportedFailures(directory)
    loggers = [logging.getLogger(name) for name in ("torch.multiprocessing.spawn", AGENT_PROCESSES_LOGGER)]
    previous = os.environ.get(REPORTED_ERRORS_ENV)
    os.environ[REPORTED_ERRORS_ENV] = str(directory)
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        if previous is None:
            os.environ.pop(REPORTED_ERRORS_ENV, None)
        else:
            os.environ[REPORTED_ERRORS_ENV] = previous
        shutil.rmtree(directory, ignore_errors=True)


def _log_worker_failures_without_traceback() -> None:
    """Keep the elastic agent's one-line "failed (exitcode: N) local_rank: R" report of a forked worker but drop the
    launcher-side traceback it attaches (torch.multiprocessing's ProcessExitedException, which says nothing the line
    does not). Formatting it through torch's log formatter imports torch._dynamo: seconds of CPU in the launcher,
    between a worker's failure and the others being stopped."""

    def without_traceback(record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True

    logging.getLogger(AGENT_PROCESSES_LOGGER).addFilter(without_traceback)


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


def run_forked_rank(argv: list[str], device_type: str = "cpu") -> None:
    """A worker of ``start_workers``, in a process forked from the forkserver: ``meshtron.worker.main(ARGV)``, as
    ``python -u -m meshtron ARGV`` runs it under torchrun. Returns on success (torch's agent waits for the return
    value); any other end leaves with its exit status, a traceback first where one was raised (none for a Ctrl-C)."""
    import signal
    import traceback

    for name in FORKSERVER_IGNORED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):  # as python -u: lines out as they are written
        cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True, write_through=True)
    if device_type == "cuda":
        _leave_if_cuda_unusable()
    reported = True  # main returns an error's status after its line; SystemExit comes after its message
    try:
        code = worker_main(argv)
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except KeyboardInterrupt:  # a SIGINT before training (or after it): the launcher says what was saved
        code, reported = 128 + signal.SIGINT, False
    except BaseException:
        traceback.print_exc()
        code, reported = 1, False
    if code:
        leave(code, reported)


def _leave_if_cuda_unusable() -> None:
    """The bad-fork check meshtron.check.worker has: a rank forked after CUDA was initialized in its forkserver
    leaves with one line (rank 0's) instead of CUDA's traceback at its first use of the device."""
    from meshtron.train.setup.rank_imports import cuda_initialized_here

    if cuda_initialized_here():
        if os.environ.get("RANK", "0") == "0":
            print(
                "meshtron: error: CUDA was initialized in the forkserver before this rank was forked, so the rank "
                "cannot use it; run with --rank-start fresh",
                file=sys.stderr,
            )
        leave(1, reported=True)
