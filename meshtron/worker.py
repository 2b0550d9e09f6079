"""One rank of ``meshtron train`` or ``meshtron eval``: its config from the command line, the checks, the process
group and the run.

Under torchrun, or started alone, the train and eval commands (meshtron.commands) call ``run_rank``. A worker that
``meshtron train|eval --nproc N`` forked from its forkserver starts at ``main`` (meshtron.launch.run_forked_rank),
with the command line its launcher gave every rank.
"""

from __future__ import annotations

import argparse

from meshtron.config import Config
from meshtron.errors import MeshtronError
from meshtron.exits import report_error
from meshtron.known_noise import quiet_known_noise

TRAIN_USAGE = "meshtron train [--config FILE] [--nproc N] [--section.key=value ...]"
EVAL_USAGE = (
    "meshtron eval CHECKPOINT_OR_MODEL_DIR [--config FILE] [--nproc N] --eval.path=DATA [--section.key=value ...]"
)


def train_config(config_file: str | None, extra: list[str]) -> Config:
    """The config of ``meshtron train [--config FILE] EXTRA`` (defaults, file, environment, overrides; validated),
    once torch's version is checked."""
    from meshtron.config import load_config, parse_overrides
    from meshtron.distributed.runtime import check_torch_version

    check_torch_version()
    return load_config(config_file, parse_overrides(extra, TRAIN_USAGE))


def eval_settings(model: str, config_file: str | None, extra: list[str]) -> tuple[Config, list[str]]:
    """The config of ``meshtron eval MODEL [--config FILE] EXTRA`` and its ``section.key=value`` overrides, once
    torch's version is checked."""
    from meshtron.checkpoint.eval_config import eval_config
    from meshtron.config import parse_overrides
    from meshtron.distributed.runtime import check_torch_version

    check_torch_version()
    overrides = parse_overrides(extra, EVAL_USAGE)
    return eval_config(model, config_file, overrides), overrides


def run_rank(cfg: Config, command: str = "train") -> int:
    """This process's rank of ``meshtron train`` (train) or ``meshtron eval`` (eval): checks, process group, the run."""
    from meshtron.distributed.devices import resolve_device_type
    from meshtron.distributed.torchrun_env import launched_world_size, local_world_size
    from meshtron.resilience.preemption import EXIT_PREEMPTED, Preempted
    from meshtron.resilience.process_group import init_runtime, shutdown_runtime
    from meshtron.resilience.watchdog import COLLECTIVE_GRACE_S
    from meshtron.train.evaluation.evaluate_run import evaluate_run
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.trainer import train

    setup = preflight(cfg, launched_world_size(), resolve_device_type(cfg.run.device, local_world_size()))
    runtime = init_runtime(  # collectives wait a little longer than the hang watchdog, which names the laggards
        timeout_s=cfg.run.collective_timeout_s + COLLECTIVE_GRACE_S,
        device=cfg.run.device,
        host_collectives=cfg.fsdp.cpu_offload,
    )
    try:
        if command == "eval":
            evaluate_run(cfg, runtime, setup)
        else:
            train(cfg, runtime, setup, planned=_planned_figures(cfg, runtime, setup))
    except Preempted as stop:
        if runtime.is_main:
            print(stop, flush=True)
        return EXIT_PREEMPTED
    finally:
        shutdown_runtime()
    return 0


def _planned_figures(cfg, runtime, setup):
    """The planner's figures for this run, which its metrics rows carry beside the measured ones (GPU runs only). A
    run the planner cannot model still trains: rank 0 says why in one line."""
    from meshtron.plan.for_run import planned_figures

    try:
        return planned_figures(cfg, runtime.world_size, runtime.rank, runtime.device, setup.hf_config)
    except Exception as err:  # the planner's figures are advice: never a reason not to train
        if runtime.is_main:
            print(f"meshtron: no planned figures for this run ({type(err).__name__}: {err})", flush=True)
        return None


def main(argv: list[str]) -> int:
    """A forked rank's ``meshtron train|eval ...``: ``train [--config FILE] OVERRIDES`` or ``eval MODEL [--config
    FILE] OVERRIDES``, as its launcher wrote it (meshtron.launch.self_launch). Returns the exit status, an error's
    after its one line."""
    quiet_known_noise()
    args, extra = _rank_parser().parse_known_args(argv)
    try:
        if args.command == "eval":
            cfg, _ = eval_settings(args.model, args.config, extra)
        else:
            cfg = train_config(args.config, extra)
        return run_rank(cfg, args.command)
    except MeshtronError as err:
        return report_error(err)


def _rank_parser() -> argparse.ArgumentParser:
    """What a rank reads from its launcher's command line: the command, eval's model, ``--config``; the rest are
    the overrides."""
    parser = argparse.ArgumentParser(prog="meshtron", add_help=False)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", add_help=False).add_argument("--config")
    evaluate = commands.add_parser("eval", add_help=False)
    evaluate.add_argument("model")
    evaluate.add_argument("--config")
    return parser
