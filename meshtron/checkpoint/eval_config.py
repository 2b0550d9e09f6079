"""The run configuration of ``meshtron eval MODEL``: a checkpoint's own run settings, or a Hugging Face model
directory on the defaults (or ``--config``), with the command line's settings on top (docs/evaluation.md)."""

from __future__ import annotations

from pathlib import Path

from meshtron.checkpoint.integrity import META, damage
from meshtron.checkpoint.manager import read_meta
from meshtron.config import Config, load_config
from meshtron.data.hub import is_hub_id
from meshtron.data.tokenizer import has_tokenizer
from meshtron.errors import ConfigError

EVAL_USAGE = (
    "meshtron eval CHECKPOINT_OR_MODEL_DIR [--config FILE] [--nproc N] [--eval.path=DATA] [--section.key=value]"
)


def is_checkpoint(path: Path) -> bool:
    return (path / META).is_file() or (path.is_dir() and path.name.startswith("step-"))


def eval_config(model: str, config_file: str | None, overrides: list[str]) -> Config:
    """The Config that evaluates ``model``: a step-N checkpoint folder (its config.toml, unless ``config_file``, and
    ``checkpoint.resume`` pointing at it) or a model directory with config.json (``model.name_or_path``, and its
    tokenizer when it has one), or a hub id. ``overrides`` (``section.key=value``) come last; nothing is saved."""
    path = Path(model).expanduser()
    if is_checkpoint(path):
        reason = damage(path)
        if reason is not None:
            raise ConfigError(f"meshtron eval: '{path}' is not a whole meshtron checkpoint ({reason})")
        read_meta(path)
        base = config_file or path / "config.toml"
        fixed = [f"checkpoint.resume={path}", "checkpoint.interval=0"]
    elif (path / "config.json").is_file():
        base = config_file
        fixed = [f"model.name_or_path={path}", "model.preset=none", "checkpoint.resume=none", "checkpoint.interval=0"]
        if has_tokenizer(path):  # its own, whatever the config file says (without one: data.tokenizer as set)
            fixed.append(f"data.tokenizer={path}")
    elif is_hub_id(model):  # its tokenizer too: data.tokenizer=auto finds it in the snapshot
        base = config_file
        fixed = [f"model.name_or_path={model}", "model.preset=none", "checkpoint.resume=none", "checkpoint.interval=0"]
    else:
        raise ConfigError(
            f"meshtron eval: '{path}' is neither a checkpoint (a step-N folder with {META}), a Hugging Face model "
            "directory (with config.json) nor a hub id (org/name); give one of them"
        )
    cfg = load_config(base, fixed + list(overrides))
    if not cfg.eval.enabled:
        raise ConfigError(
            "meshtron eval needs evaluation data: add --eval.path=DATA (or --eval.holdout_documents=N, the last N "
            "documents of data.path)"
        )
    return cfg


def check_eval_output_dir(output_dir: str | None) -> None:
    """``meshtron eval`` writes into a new (or empty) directory, never into a run's."""
    if output_dir and Path(output_dir).is_dir() and any(Path(output_dir).iterdir()):
        raise ConfigError(
            f"run.output_dir '{output_dir}' is not empty; meshtron eval writes its metrics.jsonl into a new directory"
        )
