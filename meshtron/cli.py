"""``meshtron`` command line: ``meshtron train [--config FILE] [--nproc N] [--section.key=value ...]``,
``meshtron plan ...`` (see meshtron.plan.cli), ``meshtron check [--nproc N]`` (meshtron.check),
``meshtron data prepare ...`` (meshtron.data.cli) and
``meshtron eval CHECKPOINT_OR_MODEL_DIR --eval.path=DATA`` (docs/evaluation.md),
``meshtron export CHECKPOINT OUT_DIR``, ``meshtron plot RUN_DIR ...``, ``meshtron compare RUN_A RUN_B``
(meshtron.metrics.cli) and ``meshtron generate CKPT_OR_EXPORT --prompt TEXT`` (meshtron.checkpoint.generate).

Under ``torchrun`` each process trains its rank. Started by hand, ``--nproc N`` re-launches itself
through torch's elastic launcher (meshtron.launch) on this machine; without it, one process trains alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from meshtron.errors import ConfigError, MeshtronError, note_reported_end
from meshtron.launch import RANK_STARTS, check_enough_processes, nodes_of, processes_needed, self_launch
from meshtron.plan.cli import PLAN_USAGE

USAGE = "meshtron train [--config FILE] [--nproc N] [--section.key=value ...]"
EVAL_USAGE = (
    "meshtron eval CHECKPOINT_OR_MODEL_DIR [--config FILE] [--nproc N] --eval.path=DATA [--section.key=value ...]"
)


_SETTINGS_EPILOG = "(the settings, listed when --help is printed)"


class _SettingsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``meshtron train --help``'s list of settings, made only when the help is printed: it reads the optimizer
    registry, which imports torch, and parsing a command line must not (``meshtron data``'s memory, start-up)."""

    def add_text(self, text):
        if text == _SETTINGS_EPILOG:
            from meshtron.settings_reference import help_epilog

            text = help_epilog()
        super().add_text(text)


def _add_rank_start(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--rank-start",
        choices=RANK_STARTS,
        help="with --nproc: fork each worker from a process that imported torch and transformers once (forkserver, "
        "the default), or start each as a new interpreter, as torchrun does (fresh)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtron", description="Train causal language models in parallel.")
    parser.add_argument("--version", action="store_true", help="print meshtron's, torch's and transformers' versions")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a model",
        usage=USAGE,
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
    train.add_argument("--nproc", type=int, help="launch this many processes on this machine")
    train.add_argument("--master-port", type=int, default=None, help="rendezvous port for --nproc (default: free)")
    _add_rank_start(train)
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
    evaluate = sub.add_parser(
        "eval", help="evaluate a checkpoint or a model directory on [eval] data, under any layout", usage=EVAL_USAGE
    )
    evaluate.add_argument("model", help="a checkpoint folder (step-N) or a Hugging Face model directory")
    evaluate.add_argument("--config", help="TOML config file (default: the checkpoint's own)")
    evaluate.add_argument("--nproc", type=int, help="launch this many processes on this machine")
    evaluate.add_argument("--master-port", type=int, default=None, help="rendezvous port for --nproc (default: free)")
    _add_rank_start(evaluate)
    evaluate.set_defaults(max_restarts=0)
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoint folder (e.g. runs/X/checkpoints/step-00000100)")
    export.add_argument("out_dir", help="new directory for config.json + safetensors (+ tokenizer)")
    export.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (default 2GB)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapters as a peft adapter directory (default: the merged model)",
    )
    export.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's and tokenizer's own Python code (never taken from the checkpoint)",
    )
    generate = sub.add_parser("generate", help="sample text from a checkpoint or an exported model")
    generate.add_argument("model", help="a checkpoint folder (step-N) or a Hugging Face model directory")
    generate.add_argument(
        "--prompt", default="", help="the text to continue (default: start a new document); with --chat, your message"
    )
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message through the tokenizer's chat template and print only the reply",
    )
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument("--tokenizer", help="byte or a tokenizer folder (default: the run's, or the model folder's)")
    generate.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible)")
    generate.add_argument(
        "--trust-remote-code", action="store_true", help="run the model's and tokenizer's own Python code"
    )
    from meshtron.check.cli import add_check_parser
    from meshtron.data.cli import add_data_parser
    from meshtron.metrics.cli import add_runs_parsers
    from meshtron.plan.cli import add_plan_parser

    add_plan_parser(sub)
    add_check_parser(sub)
    add_data_parser(sub)
    add_runs_parsers(sub)
    return parser


def version_line() -> str:
    """``meshtron 0.1.0 (torch X, transformers Y)``, read from the installed packages' metadata (no imports)."""
    from importlib.metadata import PackageNotFoundError, version

    from meshtron import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"meshtron {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


UNIFORM_ERROR_GRACE_S = 30.0
"""How long at most a rank other than 0 waits before leaving with an error that every rank has and only rank 0 prints:
torchrun stops all workers as soon as one exits with an error, which could stop rank 0 before its line is out. Rank 0
has the same error, so its exit ends the wait at once (the launcher stops the waiting ranks); the bound only matters
where nothing stops them. It was 2 s until a loaded CI machine started rank 0 more than 2 s after rank 1."""


def _report_error(err: MeshtronError) -> None:
    """Print ``err`` as one line: rank 0 for an error every rank has, each rank its own otherwise."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"meshtron: error: {err}", file=sys.stderr, flush=True)
    elif not err.uniform:
        print(f"meshtron: error [rank {rank}]: {err}", file=sys.stderr, flush=True)
    else:
        time.sleep(UNIFORM_ERROR_GRACE_S)


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtron.config import load_config, parse_overrides
    from meshtron.distributed.runtime import check_torch_version, launched_world_size

    check_torch_version()
    cfg = load_config(args.config, parse_overrides(extra, USAGE))
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
    if _under_torchrun():
        if args.nproc:
            raise ConfigError("--nproc cannot be used under torchrun; torchrun already started the processes")
        if args.max_restarts:
            raise ConfigError("--max-restarts is for --nproc; under torchrun use torchrun's own --max-restarts")
        if args.rank_start:
            raise ConfigError("--rank-start is for --nproc; torchrun starts each worker as a fresh interpreter")
        return _run_worker(cfg)
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
        return _run_worker(cfg)
    return self_launch(args, extra, cfg, world_size, main, nodes)


def _evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    """``meshtron eval MODEL``: one evaluation of a checkpoint or model directory, in one process or ``--nproc N``."""
    from meshtron.checkpoint.eval_config import check_eval_output_dir, eval_config
    from meshtron.config import parse_overrides
    from meshtron.distributed.runtime import check_torch_version

    check_torch_version()
    overrides = parse_overrides(extra, EVAL_USAGE)
    cfg = eval_config(args.model, args.config, overrides)
    if _under_torchrun():
        return _run_worker(cfg, command="eval")
    chosen = any(item.startswith("run.output_dir=") for item in overrides)
    if not chosen:  # never the checkpoint's run directory, which its config names
        cfg.run.output_dir = str(Path("runs") / f"eval-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
        extra = [*extra, f"--run.output_dir={cfg.run.output_dir}"]
    check_eval_output_dir(cfg.run.output_dir)
    world_size = args.nproc or 1
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    check_enough_processes(cfg, world_size, explicit=args.nproc is not None)
    if world_size == 1:
        return _run_worker(cfg, command="eval")
    return self_launch(args, extra, cfg, world_size, main, command=["eval", args.model])


def _rehearse(args: argparse.Namespace, cfg) -> int:
    from meshtron.plan.rehearsal import DEFAULT_STEPS, format_rehearsal, rehearse

    world_size = _one_rank_world_size(args, cfg, "--rehearse")
    if _under_torchrun():
        raise ConfigError("--rehearse runs one process; start it without torchrun")
    print(format_rehearsal(rehearse(cfg, world_size, args.rank, args.rehearse_steps or DEFAULT_STEPS)), flush=True)
    return 0


def _one_rank_world_size(args: argparse.Namespace, cfg, flag: str) -> int:
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


def _run_worker(cfg, command: str = "train") -> int:
    """This process's rank of ``meshtron train`` (train) or ``meshtron eval`` (eval): checks, process group, the run."""
    from meshtron.distributed.devices import resolve_device_type
    from meshtron.distributed.runtime import launched_world_size, local_world_size
    from meshtron.resilience.preemption import EXIT_PREEMPTED, Preempted
    from meshtron.resilience.process_group import init_runtime, shutdown_runtime
    from meshtron.resilience.watchdog import COLLECTIVE_GRACE_S
    from meshtron.train.evaluate_run import evaluate_run
    from meshtron.train.preflight import preflight
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


class _KnownNoise(logging.Filter):
    """Drops log records that say nothing to a meshtron user and that meshtron cannot act on."""

    PHRASES = (
        # torchao (imported by transformers' quantizers whenever it is installed) registers its Enums as pytree
        # constants, which torch 2.13 deprecates: two lines per process at every start.
        "is an Enum subclass and is now natively supported by torch.compile",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(phrase in message for phrase in self.PHRASES)


_KNOWN_NOISE = _KnownNoise()
"""One filter for every call of main (tests call it many times in one process): addFilter adds it once."""


def _quiet_known_noise() -> None:
    # transformers imports torchao when it is installed; on CPU builds it logs its unloadable CUDA kernels.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(_KNOWN_NOISE)


def main(argv: list[str] | None = None) -> int:
    _quiet_known_noise()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:  # before the parser, which wants a command
        print(version_line())
        return 0
    args, extra = _parser().parse_known_args(argv)
    if args.version:
        print(version_line())
        return 0
    try:
        if args.command == "train":
            return _train(args, extra)
        if args.command == "eval":
            return _evaluate(args, extra)
        if args.command == "plan":
            if extra:
                raise ConfigError(f"unexpected arguments {extra}; usage: {PLAN_USAGE}")
            from meshtron.plan.cli import run_plan

            return run_plan(args)
        if args.command == "check":
            if extra:
                raise ConfigError(f"unexpected arguments {extra}; see meshtron check --help")
            from meshtron.check.cli import run_check_command

            return run_check_command(args)
        if args.command == "data":
            from meshtron.data.cli import run_data

            return run_data(args, extra)
        if args.command == "generate":
            if extra:
                raise ConfigError(f"unexpected arguments {extra}; see meshtron generate --help")
            from meshtron.checkpoint.generate import generate_text

            text = generate_text(
                args.model,
                args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                tokenizer=args.tokenizer,
                trust_remote_code=args.trust_remote_code,
                device=args.device,
                chat=args.chat,
            )
            print(text if args.chat else args.prompt + text)
            return 0
        if args.command in ("plot", "compare"):
            if extra:
                raise ConfigError(f"unexpected arguments {extra}; see meshtron {args.command} --help")
            from meshtron.metrics.cli import run_compare, run_plot

            return run_plot(args) if args.command == "plot" else run_compare(args)
        if args.command == "export":
            if extra:
                raise ConfigError(f"unexpected arguments {extra}; usage: meshtron export CHECKPOINT OUT_DIR")
            from meshtron.checkpoint.export import export_checkpoint

            out = export_checkpoint(
                args.checkpoint, args.out_dir, args.max_shard_size, args.trust_remote_code, args.adapter
            )
            loads_with = "peft.PeftModel.from_pretrained" if args.adapter else "AutoModelForCausalLM.from_pretrained"
            print(f"meshtron: exported {args.checkpoint} to {out}/ (loads with {loads_with})")
    except MeshtronError as err:
        _report_error(err)
        return 2 if isinstance(err, ConfigError) else 1
    return 0


def run() -> None:
    """The ``meshtron`` command (and ``python -m meshtron``): ``main`` with its exit status.

    A torchrun worker whose process group is destroyed leaves with ``os._exit``, skipping the interpreter's
    teardown: that destroys C++ objects of torch.distributed that can still own threads (gloo's, the rendezvous
    store's), and in CI it once aborted a rank of a restarted run after the run had finished ("terminate called
    without an active exception", exit -6), which torchrun counted as a failure of the whole run. Everything a
    run writes is closed by then; stdout, stderr and logging are flushed here.

    A ``--nproc`` launcher leaves the same way once its workers have ended: its teardown (about 2,000 modules) took
    seconds on a loaded machine, between a hung run's workers being stopped and the command returning.

    A Ctrl-C outside training (which saves and stops on it) ends with status 130 and no traceback.
    """
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130  # 128 + SIGINT, as a shell reports it
        if not _under_torchrun():  # a worker's launcher says what was saved
            print("meshtron: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    else:
        if _under_torchrun():
            note_reported_end(code)  # main returns an error's status after its line: no report from torch
    launched_workers = "torch.distributed.elastic.agent.server.api" in sys.modules
    if (_under_torchrun() or launched_workers) and "torch.distributed" in sys.modules:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
