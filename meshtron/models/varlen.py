"""torch's varlen flash attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10), adapted to the installed
torch's signature: the kernel of ``model.attention_kernel=varlen`` (meshtron.models.attention_kernels).

A module of its own, imported by varlen runs only: importing torch's varlen module imports dynamo (~0.9 s of CPU),
which every launcher and command would otherwise pay for at start-up.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn
except ImportError:  # pragma: no cover - older torch
    _torch_varlen_attn = None


@dataclass(frozen=True)
class VarlenOp:
    """torch's ``varlen_attn`` (or a stand-in with the same signature, for tests), called causally with a scale and
    grouped-query heads whatever the installed torch's signature: ``window_size=(-1, 0)`` (torch >= 2.11) or
    ``is_causal=True`` (2.10) for causal; without a ``scale`` argument (2.10) the queries are multiplied by
    ``scale * sqrt(D)`` (the kernel's own scale is 1/sqrt(D)); without ``enable_gqa`` the key / value heads are
    repeated to the query heads (torch's flash kernel takes fewer kv heads, but only 2.12's signature says so).
    Autograd: torch registers the op's backward (flash attention's) from 2.10 on."""

    attend: Callable
    causal: tuple
    """(keyword, value) that makes the call causal."""
    takes_scale: bool
    takes_gqa: bool

    @classmethod
    def of(cls, attend: Callable | None) -> VarlenOp | None:
        """The adapter of ``attend``, or None when there is none or its signature has no causal argument."""
        if attend is None:
            return None
        params = inspect.signature(attend).parameters
        if "window_size" in params:
            causal: tuple[str, Any] = ("window_size", (-1, 0))
        elif "is_causal" in params:
            causal = ("is_causal", True)
        else:
            return None
        return cls(attend, causal, "scale" in params, "enable_gqa" in params)

    def __call__(self, query, key, value, cu_lengths, max_length: int, scale: float) -> torch.Tensor:
        """Causal attention within each sequence of ``cu_lengths``: ``query`` (T, H, D), ``key``/``value``
        (T, Hkv, D) -> (T, H, D). ``max_length``: a bound on the longest sequence."""
        kwargs = {self.causal[0]: self.causal[1]}
        factor = scale * query.shape[-1] ** 0.5  # the given scale over the kernel's own
        if self.takes_scale:
            kwargs["scale"] = scale
        elif abs(factor - 1.0) > 1e-12:
            query = query * factor
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            if self.takes_gqa:
                kwargs["enable_gqa"] = True
            else:
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return self.attend(query, key, value, cu_lengths, cu_lengths, max_length, max_length, **kwargs)


VARLEN = VarlenOp.of(_torch_varlen_attn)
"""The installed torch's varlen flash attention (None: torch has none); tests put a CPU stand-in here."""
