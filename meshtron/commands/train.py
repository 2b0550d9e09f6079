"""``meshtron train [--config FILE] [--nproc N] [--section.key=value ...]``: under torchrun each process trains its
rank; started by hand, ``--nproc N`` re-launches itself through torch's elastic launcher (meshtron.launch) on this
machine (or ``--nnodes`` machines); without it, one process trains alone. Also ``--print-config``, ``--dry-run`` and
``--rehearse``, which look at one rank without training a run."""

from __future__ import annotations

import argparse

from meshtron.commands.launch_flags import add_launch_flags
from meshtron.config import Config
from meshtron.distributed.torchrun_env import launched_by_torchrun
from meshtron.errors import ConfigError
from meshtron.launch import check_enough_processes, nodes_of, processes_needed, self_launch
from meshtron.worker import TRAIN_USAGE, run_rank, train_config

NAMES = ("train",)
_SETTINGS_EPILOG = "(the settings, listed when --help is printed)"


class _SettingsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``meshtron train --help``'s list of settings, made only when the help is printed: it reads the optimizer
    registry, which imports torch, and parsing a command line must not (``meshtron data``'s memory, start-up)."""

    def add_text(self, text):
        if text == _SETTINGS_EPILOG:
            from meshtron.settings_reference import help_epilog

            text = help_epilog()
        super().add_text(text)


def add_parser(sub) -> None:
    train = sub.add_parser(
        "train",
        help="train a model",
        usage=TRAIN_USAGE,
        epilog=_SETTINGS_EPILOG,
        formatter_class=_SettingsHelpFormatter,
    )
    train.add_argument("--config", help="TOML config file")
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (defaults, --config, environment, --section.key overrides; validated) as "
        "TOML, which loads back with --config, and exit without training",
    )
    add_launch_flags(train)
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc: restart all workers up to this many times after any of them fails; the "
        "run resumes from its latest checkpoint (docs/faults.md)",
    )
    train.add_argument(
        "--nnodes",
        type=int,
        help="with --nproc: machines that each start --nproc workers (each runs "
        "this command; read from SLURM under srun)",
    )
    train.add_argument("--node-rank", type=int, help="this machine's index among --nnodes (default 0)")
    train.add_argument("--rdzv-endpoint", help="with --nnodes: HOST:PORT of the first machine, the same on every one")
    train.add_argument("--rdzv-id", help="with --nnodes: a name of this job, the same on every machine")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="build one rank's sharded model on the meta device with a fake process group of --nproc "
        "ranks (default: the product of the parallel degrees when parallel.dp_shard is set, as in a meshtron "
        "plan config) and print its parameter / gradient / optimizer bytes; trains nothing",
    )
    train.add_argument("--dry-run-rank", type=int, default=0, help="the rank --dry-run builds (default 0)")
    train.add_argument(
        "--rehearse",
        action="store_true",
        help="train one rank of an --nproc N layout (N: as for --dry-run) alone, on this machine's device at its real "
        "shapes, with a fake process group (collectives move no data); write rehearsal.json "
        "(measured vs planned memory and step time) to run.output_dir",
    )
    train.add_argument("--rank", type=int, default=0, help="the rank --rehearse trains (default 0)")
    train.add_argument(
        "--rehearse-steps",
        type=int,
        default=None,
        help="steps --rehearse trains (default 4: warm-up, activations, timing)",
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    cfg = train_config(args.config, extra)
    if args.print_config:
        from meshtron.config import to_toml

        print(to_toml(cfg), end="")
        return 0
    if not args.rehearse and (args.rank or args.rehearse_steps is not None):
        raise ConfigError(
            "--rank and --rehearse-steps go with --rehearse (meshtron train --rehearse --nproc N --rank R)"
        )
    if args.rehearse and args.dry_run:
        raise ConfigError("--rehearse and --dry-run are two ways to look at one rank; give one of them")
    if args.dry_run:
        from meshtron.plan.cli import run_dry_run

        return run_dry_run(cfg, _one_rank_world_size(args, cfg, "--dry-run"), args.dry_run_rank)
    if args.rehearse:
        return _rehearse(args, cfg)
    if launched_by_torchrun():
        _refuse_launcher_flags(args)
        return run_rank(cfg)
    return _launch(args, extra, cfg)


def _refuse_launcher_flags(args: argparse.Namespace) -> None:
    """Under torchrun, the flags that would start processes are torchrun's to give."""
    if args.nproc:
        raise ConfigError("--nproc cannot be used under torchrun; torchrun already started the processes")
    if args.max_restarts:
        raise ConfigError("--max-restarts is for --nproc; under torchrun use torchrun's own --max-restarts")
    if args.rank_start:
        raise ConfigError("--rank-start is for --nproc; torchrun starts each worker as a fresh interpreter")


def _launch(args: argparse.Namespace, extra: list[str], cfg: Config) -> int:
    """Started by hand: train in this process, or start ``--nproc`` workers (on ``--nnodes`` machines)."""
    from meshtron.distributed.torchrun_env import launched_world_size

    nodes = nodes_of(args)
    if nodes is not None:
        args.nproc = args.nproc or nodes.procs_per_node
        if not args.nproc:
            raise ConfigError(f"a launch over {nodes.count} nodes needs --nproc N: the workers to start on each")
    world_size = (args.nproc or 1) * (nodes.count if nodes else 1)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    check_enough_processes(cfg, world_size, explicit=args.nproc is not None)
    # fsdp.cpu_offload in one process shards over a one-rank mesh, which needs a process group: one worker
    if world_size == 1 and launched_world_size() == 1 and not args.max_restarts and not cfg.fsdp.cpu_offload:
        return run_rank(cfg)
    return self_launch(args, extra, cfg, world_size, nodes)


def _rehearse(args: argparse.Namespace, cfg: Config) -> int:
    from meshtron.plan.rehearsal import DEFAULT_STEPS, format_rehearsal, rehearse

    world_size = _one_rank_world_size(args, cfg, "--rehearse")
    if launched_by_torchrun():
        raise ConfigError("--rehearse runs one process; start it without torchrun")
    print(format_rehearsal(rehearse(cfg, world_size, args.rank, args.rehearse_steps or DEFAULT_STEPS)), flush=True)
    return 0


def _one_rank_world_size(args: argparse.Namespace, cfg: Config, flag: str) -> int:
    """The world size whose rank ``--dry-run`` / ``--rehearse`` looks at: ``--nproc``, or else the product of the
    config's parallel degrees when every one is set (``parallel.dp_shard`` not -1, as in a ``meshtron plan``
    config)."""
    if args.nproc is not None:
        return args.nproc
    if cfg.parallel.dp_shard == -1:
        raise ConfigError(
            f"{flag} needs --nproc N (the world size) unless parallel.dp_shard is set (not -1): the world size is "
            "then the product of the parallel degrees"
        )
    return processes_needed(cfg.parallel)
