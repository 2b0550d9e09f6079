"""Float8 training (``precision.float8``): the decoder blocks' linear layers multiply in float8 with torchao.

Each matmul input (activation, weight, output gradient) is scaled by its max-abs value and cast to float8
(dynamic scaling), per tensor or per row (``precision.float8_recipe``, torchao's recipes: ``tensorwise``,
``rowwise``, ``rowwise_with_gw_hp``); weights, gradients and optimizer state stay in high precision.
Only ``tensorwise`` weights are all-gathered by FSDP, and inputs all-gathered by TP, in float8.
Embeddings and the head are not converted, nor linears with a dimension (per tensor-parallel rank) that
is not a multiple of 16. Float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada,
Hopper); elsewhere (CPU) they are emulated: the same rounding, no speed-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshtron.config import FLOAT8_RECIPES, PrecisionConfig  # torchao's Float8LinearRecipeName values
from meshtron.errors import ConfigError
from meshtron.models.adapter import DecoderAdapter

if TYPE_CHECKING:
    from meshtron.distributed.precision import PrecisionPolicy

MIN_CAPABILITY = (8, 9)
"""The oldest CUDA compute capability with float8 matmuls (Ada / Hopper)."""

# Roles (see meshtron.models.adapter) whose output / input features are split over the tp ranks.
_OUT_SPLIT_ROLES = ("colwise", "kv_colwise")
_IN_SPLIT_ROLES = ("rowwise",)


@contextlib.contextmanager
def _quiet_import():
    """torchao warns at import about CUDA kernels a CPU build of torch cannot load; hide that noise."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def import_torchao_float8():
    """The ``torchao.float8`` module, or a ConfigError saying how to install it."""
    try:
        with _quiet_import():
            import torchao.float8 as float8
    except ImportError:
        raise ConfigError("precision.float8 needs torchao; pip install 'meshtron[float8]'") from None
    return float8


def check_capability(capability: tuple[int, int], gpu: str = "this GPU") -> None:
    """Refuse a CUDA device without float8 matmuls (compute capability below 8.9)."""
    if tuple(capability) < MIN_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"precision.float8 needs a GPU of compute capability >= 8.9 (H100, L4, RTX 4090); {gpu} has "
            f"{major}.{minor}; set precision.float8=false"
        )


def float8_config(recipe: str, *, device_type: str, fsdp_enabled: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``precision.float8_recipe``).

    ``fsdp_enabled``: FSDP all-gathers the weights in float8, which torchao only does with tensorwise
    weight scales; the rowwise recipes all-gather them in high precision. Off CUDA, matmuls are emulated.
    """
    float8 = import_torchao_float8()
    if recipe not in FLOAT8_RECIPES:
        raise ConfigError(f"precision.float8_recipe: '{recipe}' is not one of {', '.join(FLOAT8_RECIPES)}")
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, enable_fsdp_float8_all_gather=fsdp_enabled and recipe == "tensorwise", emulate=device_type != "cuda"
    )


def check_float8(settings: PrecisionConfig, model_dtype: str, device_type: str, precision: PrecisionPolicy) -> None:
    """The checks of ``precision.float8`` (``settings``) that need no process group (run in preflight, on every
    rank); ``precision``: the run's policy (``precision_policy``)."""
    if not settings.float8:
        return
    recipe = settings.float8_recipe
    float8_config(recipe, device_type=device_type, fsdp_enabled=False)  # torchao present, recipe known
    if device_type == "cuda":
        check_capability(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
        if recipe != "tensorwise":
            from meshtron.models.build import torch_dtype

            # The dtype the blocks' linears multiply in (the mixed-precision dtype, else the weights').
            check_rowwise_dtype(recipe, precision.compute_dtype or torch_dtype(model_dtype))


def check_rowwise_dtype(recipe: str, dtype: torch.dtype) -> None:
    """Rowwise-scaled float8 matmuls on GPUs output bf16 (torch's CUTLASS kernel; fp32 only on some H100
    cuBLAS versions): refuse another compute dtype before the first step fails."""
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        raise ConfigError(
            f"precision.float8_recipe={recipe} needs bf16 compute on GPUs, got {name}; set "
            f"precision.mixed_precision=bf16 or precision.float8_recipe=tensorwise"
        )


def _converts(linear: nn.Linear, role: str | None, tp: int) -> bool:
    """float8 matmuls need every dimension a multiple of 16, on each rank (the tp-split one divided by tp)."""
    out_features, in_features = linear.out_features, linear.in_features
    if role in _OUT_SPLIT_ROLES:
        out_features, rest = divmod(out_features, tp)
    elif role in _IN_SPLIT_ROLES:
        in_features, rest = divmod(in_features, tp)
    else:
        rest = 0
    return rest == 0 and out_features % 16 == 0 and in_features % 16 == 0


def apply_float8(
    model: nn.Module,
    adapter: DecoderAdapter,
    *,
    device_type: str,
    fsdp_enabled: bool,
    tp: int = 1,
    recipe: str = "tensorwise",
) -> list[str]:
    """Swap the decoder blocks' ``nn.Linear`` layers for torchao ``Float8Linear`` (on the meta device,
    before tensor parallelism and FSDP). Returns the converted paths, relative to the blocks.

    ``fsdp_enabled``: FSDP all-gathers the converted weights in float8 (cast before the gather; tensorwise
    recipe only, the others all-gather in high precision).
    ``tp``: the tensor-parallel degree, so that each rank's share of a split dimension is checked.
    ``recipe``: ``precision.float8_recipe``.
    """
    float8 = import_torchao_float8()
    config = float8_config(recipe, device_type=device_type, fsdp_enabled=fsdp_enabled)
    if device_type == "cuda":
        check_capability(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    converted: list[str] = []
    for name, block in adapter.named_blocks(model):
        roles = adapter.block_tp_roles(block)

        def keep(module: nn.Module, path: str) -> bool:
            ok = isinstance(module, nn.Linear) and _converts(module, roles.get(path), tp)
            if ok:
                converted.append(f"{name}.{path}")
            return ok

        float8.convert_to_float8_training(block, config=config, module_filter_fn=keep)
    return converted


def float8_linear_paths(block: nn.Module) -> frozenset[str]:
    """Paths (relative to ``block``) of its float8 linear layers (``apply_float8`` has run)."""
    import_torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    return frozenset(path for path, sub in block.named_modules() if isinstance(sub, Float8Linear))


def float8_tp_paths(block: nn.Module) -> frozenset[str]:
    """The float8 linears of ``block`` that tensor parallelism may hand float8 inputs and output gradients
    (torchao's float8 TP styles, which cast per tensor): those of the tensorwise recipe. Rowwise ones
    keep the ordinary TP styles (high-precision collectives) and cast per row themselves."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    def tensorwise(config) -> bool:
        casts = (
            config.cast_config_input,
            config.cast_config_weight,
            config.cast_config_grad_output,
            config.cast_config_input_for_grad_weight,
            config.cast_config_weight_for_grad_input,
            config.cast_config_grad_output_for_grad_weight,
        )
        return all(
            c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE
            for c in casts
        )

    return frozenset(path for path in float8_linear_paths(block) if tensorwise(block.get_submodule(path).config))


def refresh_float8_scales(model_parts: nn.Module | list[nn.Module]) -> None:
    """Compute the float8 scales of every FSDP-sharded float8 weight from the whole weight, in one all-reduce.

    Only for FSDP's float8 all-gather (a no-op otherwise, as for the rowwise recipes, whose weights FSDP
    all-gathers in high precision). Call it once before the first step (after
    the weights are initialized or loaded) and after every ``optimizer.step()``: the scales are kept
    until the next call. Without it FSDP computes each weight's scale at its all-gather with its own
    all-reduce, over the FSDP ranks only: under tensor parallelism each tp rank then scales its shard
    by that shard's own max, which rounds differently from one process.
    """
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    float8 = import_torchao_float8()
    from torchao.float8.float8_linear import Float8Linear

    for part in parts:
        if any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in part.modules()):
            float8.precompute_float8_dynamic_scale_for_fsdp(part)
