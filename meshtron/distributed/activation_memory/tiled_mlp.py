"""Tiled MLP (``train.mlp_tiles = N``): each decoder block's MLP runs over N tiles of its tokens, one after another,
and keeps only its input for backward, which recomputes each tile's MLP and takes its gradients tile by tile. The
``tokens x intermediate_size`` activations of the MLP then never exist for the whole sequence at once: not in forward,
not kept for backward, not in backward (docs/long-context.md#tiled-mlp-trainmlp_tiles).

The MLP works on each token alone, so the result is the untiled MLP's up to the rounding of smaller matmuls. The tiles
are cut from the tokens this rank holds, on the sequence dimension, and the MLP module is called whole on each
(its hooks included): under tensor parallelism with sequence parallel, its input gather and output reduce-scatter then
run per tile and hand every rank back its own tokens of the tile.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from meshtron.errors import ConfigError

SEQUENCE_DIM = -2
"""The tokens of a block's hidden states (batch, sequence, hidden)."""


def _weights_of(mlp: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The tensors ``mlp``'s modules compute with now: (owner, name, tensor) of each registered parameter."""
    return [(owner, name, t) for owner in mlp.modules() for name, t in owner._parameters.items() if t is not None]


@contextlib.contextmanager
def _computing_with(weights: list[tuple[nn.Module, str, torch.Tensor]]):
    """The modules of ``weights`` compute with those tensors inside the block, with their own again after it."""
    own = [(owner, name, owner._parameters[name]) for owner, name, _ in weights]
    try:
        for owner, name, tensor in weights:
            owner._parameters[name] = tensor
        yield
    finally:
        for owner, name, tensor in own:
            owner._parameters[name] = tensor


class _TiledMLPFunction(torch.autograd.Function):
    """``mlp(x)`` over ``tiles`` pieces of the sequence; saves only ``x``. The MLP's trained parameters are inputs too,
    so that their gradients leave backward as any function's do: autograd accumulates them where the caller's
    backward asks for them, and only there (torch.distributed.pipelining runs backward passes of its own, on made-up
    inputs, to learn gradient shapes: gradients accumulated by hand there would land in the parameters).

    Backward recomputes the tiles with the weights the forward computed with (``weights``): a block's compute-dtype
    casts (meshtron.distributed.precision.apply_compute_casts) swap bf16 copies in for its forward only, so by
    backward the MLP holds its float32 weights again, while its saved input is bf16."""

    @staticmethod
    def forward(ctx, run_mlp, weights, tiles: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run_mlp, ctx.weights, ctx.tiles, ctx.params = run_mlp, weights, tiles, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([run_mlp(piece) for piece in x.chunk(tiles, dim=SEQUENCE_DIM)], dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        grads, param_grads = [], [None] * len(ctx.params)
        for piece, grad in zip(
            x.chunk(ctx.tiles, dim=SEQUENCE_DIM), grad_output.chunk(ctx.tiles, dim=SEQUENCE_DIM), strict=True
        ):
            piece = piece.detach().requires_grad_(True)
            with torch.enable_grad(), _computing_with(ctx.weights):
                output = ctx.run_mlp(piece)
            piece_grad, *tile_param_grads = torch.autograd.grad(output, (piece, *ctx.params), grad, allow_unused=True)
            grads.append(piece_grad)
            for i, tile_grad in enumerate(tile_param_grads):
                if tile_grad is not None:
                    param_grads[i] = tile_grad if param_grads[i] is None else param_grads[i] + tile_grad
        return None, None, None, torch.cat(grads, dim=SEQUENCE_DIM), *param_grads


def _tiled_call(self: nn.Module, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    call = super(type(self), self).__call__
    if args or kwargs or not torch.is_grad_enabled() or self.mlp_tiles <= 1:
        return call(hidden, *args, **kwargs)
    params = [param for param in self.parameters() if param.requires_grad]
    return _TiledMLPFunction.apply(call, _weights_of(self), self.mlp_tiles, hidden, *params)


@functools.cache
def _tiled_class(mlp_class: type) -> type:
    """``mlp_class`` whose calls run tiled: the same module (parameter names, state dict, tensor-parallel plan paths,
    hooks), only called differently."""
    return type(f"Tiled{mlp_class.__name__}", (mlp_class,), {"__call__": _tiled_call})


def mlp_of(block: nn.Module, roles: dict[str, str]) -> nn.Module | None:
    """A block's MLP, by its tensor-parallel role (``mlp``); None for a mixture-of-experts block."""
    paths = [path for path, role in roles.items() if role == "mlp"]
    return block.get_submodule(paths[0]) if len(paths) == 1 else None


def check_mlp_tiles(tiles: int, hf_config) -> None:
    """Refuse ``train.mlp_tiles`` for what it cannot tile: a mixture of experts, an MLP with dropout (its recomputation
    in backward would draw other masks)."""
    from meshtron.models.moe import is_moe

    if tiles <= 1:
        return
    if is_moe(hf_config):
        raise ConfigError(
            f"train.mlp_tiles={tiles}: this model's MLPs are mixtures of experts, which route each token to its "
            "experts (whose inputs are already a fraction of the tokens); set train.mlp_tiles=0"
        )
    if float(getattr(hf_config, "mlp_dropout", 0.0) or 0.0) > 0:
        raise ConfigError(
            f"train.mlp_tiles={tiles} recomputes the MLP in backward, which would draw other dropout masks than its "
            "forward (mlp_dropout > 0 in the model config); set train.mlp_tiles=0 or the model's mlp_dropout to 0"
        )


def apply_tiled_mlp(blocks: list[tuple[str, nn.Module]], roles_of, tiles: int) -> None:
    """Make each block's MLP run over ``tiles`` tiles of its tokens (``roles_of(block)``: the block's tensor-parallel
    roles, which name its MLP); a one-line ConfigError for a block without a dense MLP."""
    if tiles <= 1:
        return
    for name, block in blocks:
        mlp = mlp_of(block, roles_of(block))
        if mlp is None:
            raise ConfigError(
                f"train.mlp_tiles={tiles}: block {name} has no dense MLP (a mixture of experts routes each token to "
                "its experts, whose inputs are already a fraction of the tokens); set train.mlp_tiles=0"
            )
        if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in mlp.modules()):
            raise ConfigError(
                f"train.mlp_tiles={tiles} recomputes the MLP in backward, which would draw other dropout masks than "
                f"its forward (block {name}'s MLP has dropout); set train.mlp_tiles=0"
            )
        mlp.__class__ = _tiled_class(mlp.__class__)
        mlp.mlp_tiles = tiles
