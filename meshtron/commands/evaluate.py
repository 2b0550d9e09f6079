"""``meshtron eval CHECKPOINT_OR_MODEL_DIR --eval.path=DATA``: one evaluation of a checkpoint or a model directory,
in one process, under torchrun or with ``--nproc N`` (docs/evaluation.md)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from meshtron.commands.launch_flags import add_launch_flags
from meshtron.distributed.torchrun_env import launched_by_torchrun
from meshtron.errors import ConfigError
from meshtron.launch import check_enough_processes, self_launch
from meshtron.worker import EVAL_USAGE, eval_settings, run_rank

NAMES = ("eval",)


def add_parser(sub) -> None:
    evaluate = sub.add_parser(
        "eval", help="evaluate a checkpoint or a model directory on [eval] data, under any layout", usage=EVAL_USAGE
    )
    evaluate.add_argument("model", help="a checkpoint folder (step-N) or a Hugging Face model directory")
    evaluate.add_argument("--config", help="TOML config file (default: the checkpoint's own)")
    add_launch_flags(evaluate)
    evaluate.set_defaults(max_restarts=0)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.checkpoint.eval_config import check_eval_output_dir

    cfg, overrides = eval_settings(args.model, args.config, extra)
    if launched_by_torchrun():
        return run_rank(cfg, command="eval")
    chosen = any(item.startswith("run.output_dir=") for item in overrides)
    if not chosen:  # never the checkpoint's run directory, which its config names
        cfg = replace(cfg, run=replace(cfg.run, output_dir=str(Path("runs") / f"eval-{datetime.now():%Y%m%d-%H%M%S}")))
        extra = [*extra, f"--run.output_dir={cfg.run.output_dir}"]
    check_eval_output_dir(cfg.run.output_dir)
    world_size = args.nproc or 1
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    check_enough_processes(cfg, world_size, explicit=args.nproc is not None)
    if world_size == 1:
        return run_rank(cfg, command="eval")
    return self_launch(args, extra, cfg, world_size, command=["eval", args.model])
