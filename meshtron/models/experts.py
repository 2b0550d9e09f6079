"""The routed experts' math, on one process's tokens: dispatch by expert, grouped GEMMs, combine.

transformers' experts (meshtron.models.moe) loop over the experts; this does the same math as two grouped
GEMMs over the (token, slot) pairs sorted by expert. Expert parallelism (meshtron.distributed.expert_parallel)
runs it on the rows the all-to-all brings, and a LoRA run's experts (meshtron.models.lora) run it with their
adapters: ``ExpertAdapters`` adds ``scaling * B_e A_e x`` to each expert's two projections, as two more grouped
GEMMs through the rank, never a merged weight (which would keep a copy of every expert per layer for backward).
A family's own layout, biases and activation (gpt-oss: transposed, interleaved, biases, clamped SwiGLU) come from
its ``ExpertsAnatomy`` as an ``ExpertMath``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.models.moe import experts_anatomy


@dataclass(frozen=True)
class ExpertAdapters:
    """Low-rank updates of the local experts' two projections (meshtron.models.lora): ``gate_up`` =
    (A [E_l, r, H], B [E_l, 2I, r]), ``down`` = (A [E_l, r, I], B [E_l, H, r]); expert e's projection
    ``W_e x`` becomes ``W_e x + scaling * B_e A_e x``."""

    gate_up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    scaling: float

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.gate_up, *self.down)


@dataclass(frozen=True)
class ExpertMath:
    """What a family's experts compute beyond their two fused matrices (meshtron.models.moe.ExpertsAnatomy):
    ``glu`` maps the gate/up projection (N, 2I) to the down projection's input (N, I); ``transposed``: the
    matrices are ``[E, in, out]``; ``biases``: (gate_up bias [E_l, 2I], down bias [E_l, H]) or None."""

    glu: Callable[[torch.Tensor], torch.Tensor]
    transposed: bool = False
    biases: tuple[torch.Tensor, torch.Tensor] | None = None


def expert_math(experts: nn.Module, local=lambda t: t) -> ExpertMath:
    """The ``ExpertMath`` of a transformers experts module, by its family's anatomy; ``local`` turns its bias
    parameters into the tensors to use (expert parallelism: this rank's shards)."""
    anatomy = experts_anatomy(experts)
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    if anatomy.activation == "clamped_swiglu":
        activation = functools.partial(clamped_swiglu, alpha=experts.alpha, limit=experts.limit)
    else:
        act_fn = experts.act_fn

        def activation(gate, up):
            return act_fn(gate) * up

    def glu(h: torch.Tensor) -> torch.Tensor:
        gate, up = (h[..., ::2], h[..., 1::2]) if anatomy.interleaved else h.chunk(2, dim=-1)
        return activation(gate, up)

    biases = (local(experts.gate_up_proj_bias), local(experts.down_proj_bias)) if anatomy.biases else None
    return ExpertMath(glu=glu, transposed=anatomy.transposed, biases=biases)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation (``GptOssExperts._apply_gate``): gate clamped to at most ``limit``, up to +-``limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def local_expert_ffn(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: torch.Tensor,
    math: ExpertMath,
    use_grouped_mm: bool | None = None,
    adapters: ExpertAdapters | None = None,
    host_counts: list[int] | None = None,
) -> torch.Tensor:
    """The experts' FFN on rows ``x`` (N, H) grouped by expert: ``counts[e]`` consecutive rows for each
    local expert ``e`` of ``gate_up`` [E_l, 2I, H] / ``down`` [E_l, H, I] (``math.transposed``: [E_l, H, 2I] /
    [E_l, I, H]). Returns (N, H).

    Same math as transformers' experts: ``h = x @ gate_up[e].T (+ bias[e])``, ``math.glu(h) @ down[e].T
    (+ bias[e])``; as grouped GEMMs (``torch._grouped_mm``) or, if that is unavailable or ``use_grouped_mm`` is
    False, a loop over the experts that have rows. ``adapters``: LoRA's update of both projections (in the loop
    when their rank is too small for the grouped GEMM's 16-byte strides). ``host_counts``: ``counts`` as host
    integers where the caller has them (the loop needs them; without them it reads ``counts``, a host sync on a GPU).
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_available(gate_up)
    use_grouped_mm = use_grouped_mm and (adapters is None or _aligned(adapters))
    gate_up_bias, down_bias = math.biases or (None, None)

    def as_in_out(weight):  # [E, in, out] for the grouped GEMM
        return weight if math.transposed else weight.transpose(-2, -1)

    if use_grouped_mm and x.shape[0] > 0:
        offsets = torch.cumsum(counts.to(x.device), 0, dtype=torch.int32)

        def project(rows, weight, bias, factors):
            out = torch._grouped_mm(rows, as_in_out(weight), offs=offsets)
            if factors is not None:
                low = _ContiguousGrad.apply(torch._grouped_mm(rows, factors[0].transpose(-2, -1), offs=offsets))
                out = out + adapters.scaling * torch._grouped_mm(low, factors[1].transpose(-2, -1), offs=offsets)
            if bias is not None:
                out = out + bias.repeat_interleave(counts.to(bias.device), dim=0, output_size=rows.shape[0])
            return _ContiguousGrad.apply(out)

        h = project(_ContiguousGrad.apply(x.to(gate_up.dtype)), gate_up, gate_up_bias, adapters and adapters.gate_up)
        return project(_ContiguousGrad.apply(math.glu(h)), down, down_bias, adapters and adapters.down)

    def project_one(rows, weight, bias, factors, e):
        out = rows @ weight[e] if math.transposed else nn.functional.linear(rows, weight[e])
        if bias is not None:
            out = out + bias[e]
        if factors is not None:
            out = out + adapters.scaling * nn.functional.linear(
                nn.functional.linear(rows, factors[0][e]), factors[1][e]
            )
        return out

    pieces = []
    start = 0
    for e, n in enumerate(counts.tolist() if host_counts is None else host_counts):
        if n:
            h = project_one(x[start : start + n], gate_up, gate_up_bias, adapters and adapters.gate_up, e)
            pieces.append(project_one(math.glu(h), down, down_bias, adapters and adapters.down, e))
        start += n
    if not pieces:
        # No rows: keep the rows and the parameters in the graph all the same, so that backward runs
        # this rank's side of the dispatch all-to-all (the other ranks wait for it) and the parameters
        # get (zero) gradients.
        weights = (gate_up, down, *(math.biases or ()), *(adapters.tensors() if adapters else ()))
        hidden = down.shape[2] if math.transposed else down.shape[1]
        return x.new_zeros(0, hidden) + 0 * (x.sum() + sum(w.sum() for w in weights))
    return torch.cat(pieces)


def _grouped_mm_available(weight: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if weight.device.type == "cuda":
        return torch.cuda.get_device_capability(weight.device) >= (8, 0) and weight.dtype == torch.bfloat16
    return weight.device.type == "cpu"


def _aligned(adapters: ExpertAdapters) -> bool:
    """Whether the adapters' rank suits the grouped GEMM (strides of a multiple of 16 bytes); the loop otherwise."""
    a = adapters.gate_up[0]
    return (a.shape[1] * a.element_size()) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm``'s backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """(order, token index, counts per expert) of the flattened (token, slot) pairs sorted by expert id
    (stable: within an expert, in token order). The counts come from a search of the sorted ids, on the device:
    ``bincount`` reads the ids' minimum and maximum on the host (two syncs on a GPU)."""
    flat = top_k_index.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(ids, torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype))
    return order, order // top_k_index.shape[-1], bounds.diff()


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] == i`` (one scatter of distinct indices: deterministic)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _Permute(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` of x's rows, ``inverse`` its inverse: backward is the gather
    ``grad[inverse]``, not indexing's accumulating scatter (``index_put`` with ``accumulate``)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """``x[index]`` for a permutation ``index`` of x's rows (``inverse``: its inverse, if at hand), with a gather as
    backward (see ``_Permute``)."""
    return _Permute.apply(x, index, inverse_permutation(index) if inverse is None else inverse)


class _PairRows(torch.autograd.Function):
    """``hidden[token]``: each token's row once for each of its ``k`` (token, slot) pairs, in the pairs' sorted
    ``order`` (``token = order // k``). Backward unpermutes the pairs' gradients to (token, slot) order and sums each
    token's ``k`` slots, a reduction in a fixed order, where indexing's backward accumulates them with atomics on
    a GPU (an order that varies from run to run)."""

    @staticmethod
    def forward(ctx, hidden, token, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.shape = (hidden.shape[0], k, hidden.shape[-1])
        return hidden.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        pairs = grad.index_select(0, inverse)
        return pairs.view(ctx.shape).sum(dim=1), None, None, None


def pair_rows(
    hidden: torch.Tensor, order: torch.Tensor, token: torch.Tensor, k: int, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """The experts' input rows ``hidden[token]`` (``sort_by_expert``'s order and token; ``k`` experts per token;
    ``inverse``: ``inverse_permutation(order)``, if at hand), with a deterministic backward (see ``_PairRows``)."""
    return _PairRows.apply(hidden, token, inverse_permutation(order) if inverse is None else inverse, k)


def combine(
    rows: torch.Tensor,
    order: torch.Tensor,
    top_k_weights: torch.Tensor,
    dtype: torch.dtype,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight the expert outputs ``rows`` (in expert-sorted pair order: row ``i`` is flattened (token, slot) pair
    ``order[i]``) by their routing weights ``top_k_weights`` (T, k) and sum them per token: unpermuted to (token,
    slot) order and summed over the slots (T, k, H) -> (T, H) in ``dtype``.

    Deterministic, forward and backward: a token's k outputs add up in slot order whatever order the pairs came in
    (no ``index_add``, whose atomics on a GPU add in an order that varies, so tensor-parallel ranks computing the
    same replicated block got bitwise different results). Equal to transformers' ``index_add`` per expert to fp32
    rounding (bitwise for k <= 2). ``inverse``: ``inverse_permutation(order)``, if at hand (the dispatch's: one
    index tensor kept for backward, not two). For backward it keeps ``rows`` and the weights, as ``index_add``
    did, but not the weighted rows, which ``index_add`` kept too."""
    tokens, k = top_k_weights.shape
    inverse = inverse_permutation(order) if inverse is None else inverse
    weights = permute(top_k_weights.reshape(-1), order, inverse)
    weighted = (rows * weights.unsqueeze(-1)).to(dtype)
    return permute(weighted, inverse, order).view(tokens, k, rows.shape[-1]).sum(dim=1)


def local_experts_forward(
    experts: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    use_grouped_mm: bool | None = None,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """Single-process dispatch / grouped GEMM / combine over all experts of ``experts`` (no EP): the
    local math of the EP forward, equal to transformers' experts forward."""
    order, token, counts = sort_by_expert(top_k_index, experts.gate_up_proj.shape[0])
    inverse = inverse_permutation(order)
    math = expert_math(experts)
    rows = local_expert_ffn(
        pair_rows(hidden, order, token, top_k_index.shape[-1], inverse),
        experts.gate_up_proj,
        experts.down_proj,
        counts,
        math,
        use_grouped_mm,
        adapters,
    )
    return combine(rows, order, top_k_weights, hidden.dtype, inverse)
