"""The optimizers ``optimizer.name`` can name: each an ``OptimizerEntry`` in ``OPTIMIZERS``, with its builder, its
own settings (``[optimizer.<name>]``) and what the planner (meshtron.plan) needs to cost it. Adding one: its module
and its entry here (CONTRIBUTING.md, "Adding an optimizer"; docs/optimizers.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from meshtron.config import OptimizerConfig, coerce_value, did_you_mean, field_types
from meshtron.errors import ConfigError
from meshtron.train.optim.adamw import AdamWSettings, build_adamw
from meshtron.train.optim.muon import MuonSettings, build_muon, newton_schulz_flops


@dataclass(frozen=True)
class OptimizerEntry:
    build: Callable[..., torch.optim.Optimizer]
    """``build(model, cfg: OptimizerConfig, settings, *, parts, adapter, compute_dtype)``: the optimizer of the
    model's trained parameters (``parts``: this rank's pipeline stages; ``adapter``: their family's)."""
    settings: type
    """A frozen dataclass of its own settings, ``[optimizer.<name>]`` (defaults: its fields'), with ``validate()``."""
    state_copies: int = 2
    """Optimizer-state copies per trained parameter, in the model dtype (AdamW: its two moments)."""
    matrix_state_copies: int | None = None
    """Copies for the decoder blocks' matrices it steps itself (Muon: one momentum buffer); None: none stepped apart."""
    matrix_step_flops: Callable[[Any, int, int], float] | None = None
    """``(settings, rows, cols)``: FLOPs of its step on one whole block matrix, which the planner times with the
    matrix's gather (Muon's Newton-Schulz); None: no such step."""
    adamw_pass: bool = False
    """Its step is one fused AdamW pass over every trained parameter (the planner's calibrated bytes per parameter)."""


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry(build=build_adamw, settings=AdamWSettings, state_copies=2, adamw_pass=True),
    "muon": OptimizerEntry(
        build=build_muon,
        settings=MuonSettings,
        state_copies=2,  # AdamW for the embeddings, head, norms, biases and routers
        matrix_state_copies=1,
        matrix_step_flops=newton_schulz_flops,
    ),
}


def optimizer_entry(name: str) -> OptimizerEntry:
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name: '{name}' is not one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def optimizer_settings(cfg: OptimizerConfig, name: str | None = None) -> Any:
    """The settings dataclass of optimizer ``name`` (default ``cfg.name``) from ``cfg.settings[name]``, checked: an
    unknown key or a bad value is a one-line ConfigError naming ``optimizer.<name>.<key>``."""
    name = cfg.name if name is None else name
    kind = optimizer_entry(name).settings
    types_ = field_types(kind)
    given = cfg.settings.get(name, {})
    for key in given:
        if key not in types_:
            known = ", ".join(sorted(types_)) or "none"
            raise ConfigError(
                f"unknown config key 'optimizer.{name}.{key}';{did_you_mean(key, types_, prefix=f'optimizer.{name}.')} "
                f"{name}'s own settings: {known}"
            )
    values = {
        key: coerce_value(f"optimizer.{name}.{key}", value, types_[key], from_text=False)
        for key, value in given.items()
    }
    settings = kind(**values)
    settings.validate()
    return settings


def check_optimizer(cfg: OptimizerConfig) -> None:
    """``optimizer.name`` is in the registry and every ``[optimizer.<name>]`` table given is valid (before any
    collective: the preflight's)."""
    optimizer_entry(cfg.name)
    for name in cfg.settings:
        if name not in OPTIMIZERS:
            raise ConfigError(
                f"unknown config key 'optimizer.{name}': no optimizer '{name}';{did_you_mean(name, OPTIMIZERS)} the "
                f"optimizers: {', '.join(OPTIMIZERS)}"
            )
        optimizer_settings(cfg, name)
