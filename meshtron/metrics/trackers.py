"""Experiment trackers, where logged steps go besides ``metrics.jsonl``: TensorBoard and Weights & Biases (chosen
by the ``run.loggers`` setting).

Only rank 0 logs. Each tracker gets the rows ``metrics.jsonl`` gets (every number in them, under ``train/``, at the
row's step) and, once at the start, the resolved config and the layout.
"""

from __future__ import annotations

import importlib.util
import netrc
import numbers
import os
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

import tomli_w

from meshtron.config import RunConfig
from meshtron.errors import ConfigError, MeshtronError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""run.loggers entry -> the package it needs (and the meshtron extra that installs it)."""
TENSORBOARD_DIR = "tensorboard"


def check_trackers(run: RunConfig, env=os.environ) -> None:
    """A one-line error, before any work (on every rank), for a tracker whose package is not installed, or W&B
    online without an API key."""
    for name in run.loggers:
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"run.loggers: '{name}' needs the {package} package: pip install 'meshtron[{name}]' "
                f"(or {package}), or remove '{name}' from run.loggers"
            )
    if "wandb" in run.loggers and run.wandb_mode == "online" and not _wandb_api_key(env):
        raise ConfigError(
            "run.wandb_mode=online needs a W&B API key: run `wandb login` or set WANDB_API_KEY, or set "
            "run.wandb_mode=offline (upload later with `wandb sync`)"
        )


def _wandb_api_key(env) -> bool:
    """Whether W&B will find an API key: WANDB_API_KEY, or the ~/.netrc entry that `wandb login` writes."""
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(env.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics row (not its step) as a tracker names them: ``eval/loss`` for ``eval_loss`` (the
    evaluation's), ``train/loss`` for ``loss`` and the step's other numbers."""
    return {
        (f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"): float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


class TensorBoardTracker:
    """Event files in ``<output_dir>/tensorboard`` (``tensorboard --logdir <output_dir>``)."""

    def __init__(self, output_dir: Path, run: RunConfig, settings: dict, layout: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(output_dir) / TENSORBOARD_DIR))
        self.writer.add_text("layout", layout, 0)
        self.writer.add_text(
            "config", "    " + tomli_w.dumps(settings).replace("\n", "\n    "), 0
        )  # markdown code block

    def log(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (``run.wandb_project``, ``run.wandb_mode``), named after the output directory."""

    def __init__(self, output_dir: Path, run: RunConfig, settings: dict, layout: str):
        import wandb

        try:
            self.run = wandb.init(
                project=run.wandb_project,
                mode=cast(Any, run.wandb_mode),  # one of wandb's modes: config's CHOICES checked it
                dir=str(output_dir),
                name=Path(output_dir).name,
                config={**settings, "layout": layout},
            )
        except Exception as err:  # noqa: BLE001 - wandb raises many kinds (no key, no network, ...)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise MeshtronError(
                f"run.loggers: W&B could not start ({reason}); run `wandb login` or set WANDB_API_KEY, "
                "or set run.wandb_mode=offline (sync later with `wandb sync`)"
            ) from None

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def build_trackers(run: RunConfig, settings: dict, output_dir: Path, layout: str) -> list:
    """The trackers ``run.loggers`` asks for besides jsonl (call on rank 0 only); ``settings``: the run's whole
    configuration as ``config.to_dict`` gives it, which each tracker records."""
    loggers = dict.fromkeys(run.loggers)
    return [TRACKERS[name](output_dir, run, settings, layout) for name in loggers if name in TRACKERS]
