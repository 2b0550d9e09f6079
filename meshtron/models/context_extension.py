"""Context extension: ``model.max_position_embeddings`` and ``model.rope_scaling`` applied to any Hugging Face config
with rotary position embeddings (docs/models.md#longer-context-modelrope_scaling).

The rope types are the installed transformers' own (``ROPE_INIT_FUNCTIONS``: linear, dynamic, yarn, llama3, longrope,
...): the model's rotary module computes the scaled frequencies, so every layout, the export and plain transformers
use the same ones. ``rope_scaling`` is merged into the config's ``rope_parameters`` (transformers 5's name for what
config.json called ``rope_scaling``), into each layer type's entry for models with several (Gemma 3), or per layer
type when its keys are layer types.
"""

from __future__ import annotations

import copy
import numbers
from typing import Any

from meshtron.errors import ConfigError

EXTENDING_TYPES = ("linear", "yarn", "llama3", "longrope")
"""Rope types whose ``factor`` stretches the pretrained positions: unless model.max_position_embeddings is set, the
model then takes ``factor`` x its pretrained length. (``dynamic`` scales only beyond max_position_embeddings, at
generation: training, which stays within it, uses the plain frequencies.)"""
KEEPS_PRETRAINED_LENGTH = ("yarn", "llama3", "longrope")
"""Rope types that read the pretrained length (``original_max_position_embeddings``) from their parameters."""


def extend_context(hf_config, model_cfg) -> None:
    """Apply ``model_cfg.rope_scaling`` and ``model_cfg.max_position_embeddings`` to ``hf_config`` in place; a
    one-line ConfigError names the setting that cannot apply."""
    scaling, positions = dict(model_cfg.rope_scaling or {}), model_cfg.max_position_embeddings
    if not scaling and positions is None:
        return
    pretrained = getattr(hf_config, "max_position_embeddings", None)
    if pretrained is None:
        raise ConfigError(
            f"model.max_position_embeddings / model.rope_scaling: model_type '{hf_config.model_type}' has no "
            "max_position_embeddings (its positions are not rotary); unset them"
        )
    if scaling:
        factor = _apply_rope_scaling(hf_config, scaling, _pretrained_length(hf_config))
        if positions is None and factor is not None:
            positions = int(pretrained * factor)
    if positions is not None:
        hf_config.max_position_embeddings = positions


def _pretrained_length(hf_config) -> int:
    """The length the model was pretrained at: a rope type's own record of it, Phi-3's attribute, or its positions."""
    for entry in _rope_entries(hf_config):
        if entry and entry.get("original_max_position_embeddings"):
            return int(entry["original_max_position_embeddings"])
    return int(getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings)


def _rope_entries(hf_config) -> list[dict]:
    """The config's rope parameters: one entry per layer type (Gemma 3), or the one for every layer."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return [rope[key] for key in _layer_type_keys(hf_config, rope)] or [rope]


def _layer_type_keys(hf_config, rope: dict) -> list[str]:
    nested = getattr(hf_config, "nested_rope_parameter_keys", None)
    return list(nested(rope)) if nested is not None else []


def _apply_rope_scaling(hf_config, scaling: dict[str, Any], pretrained: int) -> float | None:
    """Merge ``scaling`` into the config's rope parameters and validate them; returns the extending factor or None."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = copy.deepcopy(getattr(hf_config, "rope_parameters", None))
    if not rope or not hasattr(hf_config, "validate_rope"):
        raise ConfigError(
            f"model.rope_scaling: model_type '{hf_config.model_type}' has no rotary position embeddings "
            "(rope_parameters) in this transformers; unset model.rope_scaling"
        )
    layer_types = _layer_type_keys(hf_config, rope)
    if layer_types and set(scaling) <= set(layer_types):  # {full_attention = {rope_type = "linear", factor = 8.0}}
        per_type = {key: dict(value) for key, value in scaling.items()}
    else:
        per_type = {key: scaling for key in layer_types} if layer_types else {None: scaling}
    factors = []
    for key, given in per_type.items():
        if not isinstance(given, dict):
            raise ConfigError(f"model.rope_scaling.{key}: expected a table of rope parameters, got {given!r}")
        entry = rope[key] if key is not None else rope
        merged = _merged(entry, given, pretrained, ROPE_INIT_FUNCTIONS)
        if key is None:
            rope = merged
        else:
            rope[key] = merged
        if merged["rope_type"] in EXTENDING_TYPES and "factor" in merged:
            factors.append(float(merged["factor"]))
    hf_config.rope_parameters = rope
    try:
        hf_config.validate_rope()
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"model.rope_scaling: {str(err).strip(chr(34))}; see docs/models.md") from None
    return max(factors) if factors else None


def _merged(entry: dict, given: dict[str, Any], pretrained: int, known: dict) -> dict:
    """One rope entry with ``given`` on top: a new rope type keeps only the base parameters of the old one."""
    rope_type = given.get("rope_type", given.get("type", entry.get("rope_type", "default")))
    if rope_type != "default" and rope_type not in known:
        raise ConfigError(
            f"model.rope_scaling: rope_type '{rope_type}' is not one this transformers knows; use one of "
            + ", ".join(sorted(known))
        )
    base_keys = ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings", "mrope_section")
    kept = entry if rope_type == entry.get("rope_type", "default") else {k: entry[k] for k in base_keys if k in entry}
    merged = {**kept, **{k: v for k, v in given.items() if k != "type"}, "rope_type": rope_type}
    factor = merged.get("factor")
    if factor is not None and (not isinstance(factor, numbers.Real) or isinstance(factor, bool) or factor < 1):
        raise ConfigError(f"model.rope_scaling: factor must be a number >= 1, got {factor!r}")
    if rope_type in KEEPS_PRETRAINED_LENGTH:
        merged.setdefault("original_max_position_embeddings", pretrained)
    return merged


def check_rope_layout(hf_config, seq_len: int, cp: int, mask_documents: bool) -> None:
    """Refuse a longrope model trained past its pretrained length where its frequencies would differ between
    micro-batches or ranks: longrope takes its long or short factors by the largest position of each forward, which
    document masks (positions restart per document) and context parallelism (each rank holds part of a sequence)
    make depend on the batch and the layout."""
    for entry in _rope_entries(hf_config):
        if not entry or entry.get("rope_type") != "longrope":
            continue
        pretrained = int(entry.get("original_max_position_embeddings") or _pretrained_length(hf_config))
        if seq_len > pretrained and (mask_documents or cp > 1):
            raise ConfigError(
                f"data.seq_len {seq_len} is past the model's pretrained length {pretrained} under longrope, which "
                "picks its factors by the largest position of each forward: with document masks or context "
                "parallelism they would differ between micro-batches and layouts; set data.mask_documents=false and "
                "parallel.cp=1, or model.rope_scaling={rope_type='yarn', factor=...}"
            )
