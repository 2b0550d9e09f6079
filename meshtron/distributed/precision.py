"""Mixed precision in every layout, from one setting (``precision.mixed_precision``): the policy and the casts.

Master weights and AdamW state stay in ``model.dtype`` (float32 by default); the forward and backward
compute in the chosen dtype; gradients are reduced in ``fsdp.reduce_dtype`` (float32 by default).

* With FSDP / HSDP (also meshtron's DDP-style replication, which is ``fully_shard`` on a 1-wide shard
  mesh) it is FSDP's own ``MixedPrecisionPolicy``: parameters are cast when they are gathered.
* Without FSDP (one process, TP-only, PP-only, PP x TP) ``apply_compute_casts`` does what FSDP does,
  at the same places: before each decoder block's forward and the root's, parameters are swapped for
  compute-dtype copies (a differentiable cast, so their gradients arrive in the master dtype; made once
  per optimizer step and reused by every micro-batch and recomputation) and floating inputs are cast too.
  Every layout therefore runs the same arithmetic, which is what lets the parity tests compare them with
  each other and with one process. The cast's backward makes each master gradient in one pass over the
  parameter: the first micro-batch's float32 gradient is the conversion itself (autograd assigns it, no
  add), a later micro-batch's compute-dtype gradient is added into the float32 one in one kernel (the
  conversion and the accumulation at once, the same float32 sum as before).

fp16's loss scaling is a training-loop matter: ``meshtron.train.loss.scaling``. CPU runs use ``none`` under
``auto``; bf16 (and fp16) also run on CPU, which is how the tests check this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.utils import _apply_to_tensors

from meshtron.config import PrecisionConfig
from meshtron.errors import ConfigError
from meshtron.models.adapter import DecoderAdapter
from meshtron.models.build import torch_dtype
from meshtron.tensors import storage_address

_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """``compute_dtype`` None means: compute in the parameters' own dtype (no mixed precision)."""

    compute_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    name: str = "none"

    @property
    def loss_scaling(self) -> bool:
        return self.compute_dtype == torch.float16

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)

    def describe(self) -> str:
        return "no mixed precision" if self.compute_dtype is None else f"{self.name} compute"


def resolve_mixed_precision(setting: str, device_type: str, bf16_supported: bool | None = None) -> str:
    """``bf16``, ``fp16`` or ``none`` for ``precision.mixed_precision`` on ``device_type`` (auto resolved)."""
    if setting != "auto":
        return setting
    if device_type != "cuda":
        return "none"
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    return "bf16" if bf16_supported else "fp16"


def precision_policy(
    precision: PrecisionConfig, model_dtype: str, reduce_dtype: str | None, device_type: str
) -> PrecisionPolicy:
    """The run's policy (``[precision]``, ``model.dtype``, ``fsdp.reduce_dtype``); a ConfigError for a combination
    that cannot work."""
    if model_dtype == "float16":
        # AdamW's eps (1e-8) is 0 in fp16: rows without gradient get 0/0 and the run diverges at step 2.
        raise ConfigError(
            "model.dtype=float16 stores the weights and AdamW state in fp16, where AdamW's eps underflows and "
            "training diverges; use model.dtype=float32 with precision.mixed_precision=fp16 (fp16 compute, fp32 "
            "master weights, loss scaling) or model.dtype=bfloat16"
        )
    name = resolve_mixed_precision(precision.mixed_precision, device_type)
    reduce = torch_dtype(reduce_dtype) if reduce_dtype else None
    if name == "none":
        return PrecisionPolicy(None, reduce, name)
    compute = _COMPUTE_DTYPES[name]
    master = torch_dtype(model_dtype)
    if master == compute or (master != torch.float32 and precision.mixed_precision == "auto"):
        return PrecisionPolicy(None, reduce, "none")  # compute in the weights' own (half) dtype
    if master != torch.float32:
        raise ConfigError(
            f"precision.mixed_precision={name} with model.dtype={model_dtype}: master weights must be float32 "
            f"(or already {name}); set model.dtype=float32"
        )
    return PrecisionPolicy(compute, reduce, name)


def _accumulation_runs(ctx) -> bool:
    """Whether this backward ends in the parameter's AccumulateGrad (``loss.backward()``), rather than handing the
    gradient to the caller (``torch.autograd.grad``, as zero-bubble pipeline schedules compute weight gradients)."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return False
    try:
        return bool(will_execute(ctx.next_functions[0][0]))
    except RuntimeError:  # autograd.grad() with the parameter as an input: its gradient is captured, not accumulated
        return False


WIDEN_MIN_NUMEL = 132 * 65536
"""Gradients of at least this many elements are widened by ``torch._foreach_copy_`` (``widened``): its CUDA kernel
gives each 65,536-element chunk one block, so a smaller tensor leaves some of an H100's 132 SMs idle, where
``.to`` spreads over all of them."""


def widened(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad.to(dtype)``, the same values; a big gradient written by ``torch._foreach_copy_``, whose CUDA kernel
    (multi_tensor_apply) loads and stores vectors of 4 elements, where ``grad.to`` from bf16 to float32 runs torch's
    unrolled elementwise copy (4.1 ms a step for llama-1b's 1.24 B gradients on an H200, 1.8 TB/s). Whether it is
    faster is **not yet measured on a GPU** (``bench/one_gpu_checks`` ``gradient_widening``, per shape). Plain
    contiguous tensors of ``WIDEN_MIN_NUMEL`` elements or more, outside a differentiable backward only
    (``_foreach_copy_`` has no derivative); the others take ``grad.to``."""
    plain = type(grad) is torch.Tensor and grad.is_contiguous() and not grad.requires_grad
    if not plain or grad.dtype == dtype or grad.numel() < WIDEN_MIN_NUMEL:
        return grad.to(dtype)
    out = torch.empty_like(grad, dtype=dtype)
    torch._foreach_copy_([out], [grad])
    return out


class _ComputeCast(torch.autograd.Function):
    """``param.to(dtype)`` whose backward makes the master gradient in one pass over the parameter.

    Without a gradient held yet it returns the gradient converted to the master dtype, which AccumulateGrad
    takes as ``param.grad`` (assigned, not added). With one held (a later micro-batch of the step) it adds the
    compute-dtype gradient into it in place, one kernel that reads it in its own dtype and adds in float32,
    where ToCopyBackward + AccumulateGrad converted it first (a float32 copy) and added that (a second pass):
    the same float32 sum, bit for bit. Only for plain tensors under a plain ``backward()`` without hooks on the
    parameter; otherwise (DTensor gradients of tensor parallelism, ``autograd.grad``, double backward) it
    returns the converted gradient as ToCopyBackward does.
    """

    @staticmethod
    def forward(ctx, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.param = param
        return param.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        param = ctx.param
        held = param.grad if param.is_leaf else None
        if (
            held is not None
            and type(held) is torch.Tensor
            and type(grad) is torch.Tensor
            and held.dtype == param.dtype
            and held.shape == grad.shape
            and held.layout == torch.strided
            and not torch.is_grad_enabled()
            and not param._backward_hooks
            and getattr(param, "_post_accumulate_grad_hooks", None) is None
            and _accumulation_runs(ctx)
        ):
            held.add_(grad)  # float32 += compute dtype: the conversion and the accumulation in one kernel
            return None, None
        return widened(grad, param.dtype), None


WEIGHT_COPY_MARK = "_meshtron_weight_copy"
"""Set on each compute-dtype copy of a master weight (ComputeWeights), which lives through the step."""


def is_weight_copy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a compute-dtype weight copy (ComputeWeights) or a view of one (a weight transposed for a
    matmul): the step holds it anyway, so moving what autograd saves of it elsewhere frees nothing."""
    return getattr(tensor, WEIGHT_COPY_MARK, False) or getattr(getattr(tensor, "_base", None), WEIGHT_COPY_MARK, False)


class ComputeWeights:
    """The compute-dtype copies of master weights, made once per optimizer step.

    A copy is a differentiable cast (its gradient reaches the master weight in the master dtype), made at
    the first use after the weight last changed (``param._version``: the optimizer step, a checkpoint load
    or a rollback bump it) and reused by every later micro-batch and by activation-checkpoint recomputation.
    ``release`` drops them (after each step's backward), so they do not sit in memory through the
    optimizer step. Copies made without autograd (evaluation) are never handed to a forward that trains.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._addresses: set[int] = set()  # the copies' storages (storage_address)

    def copy_of(self, param: torch.Tensor) -> torch.Tensor:
        trains = torch.is_grad_enabled() and param.requires_grad
        entry = self._copies.get(id(param))
        if entry is not None and entry[0] is param and entry[1] == param._version and entry[2].requires_grad == trains:
            return entry[2]
        if entry is not None:  # replaced: its storage may go to anything from now on
            self._addresses.discard(storage_address(entry[2]))
        copy = _ComputeCast.apply(param, self.dtype) if trains else param.to(self.dtype)
        setattr(copy, WEIGHT_COPY_MARK, True)
        self._copies[id(param)] = (param, param._version, copy)
        self._addresses.add(storage_address(copy))
        return copy

    def holds(self, address: int) -> bool:
        """Whether the storage at ``address`` is a copy's (compiled code saves a DTensor copy's local tensor, which
        carries no mark)."""
        return address != 0 and address in self._addresses

    def release(self) -> None:
        self._copies.clear()
        self._addresses.clear()


COMPUTE_WEIGHTS_ATTRIBUTE = "_meshtron_compute_weights"
"""The attribute of a model (or pipeline stage) that holds its ComputeWeights (see release_compute_weights)."""


class _CastHooks:
    """Forward hooks that let ``module`` compute with compute-dtype copies of its own parameters (those not
    inside ``skip``, which get hooks of their own), as FSDP's param_dtype does, and cast floating inputs.
    Parameters are looked up at every call: materializing the model after this replaces them."""

    def __init__(self, module: nn.Module, weights: ComputeWeights, skip: list[nn.Module]):
        self.weights = weights
        skipped = {id(inner) for outer in skip for inner in outer.modules()}
        self.owners = [owner for owner in module.modules() if id(owner) not in skipped]
        self.originals: list[tuple[nn.Module, str, nn.Parameter]] = []

    def before(self, module, args, kwargs):
        dtype = self.weights.dtype
        self.originals = []
        for owner in self.owners:
            for name, param in list(owner._parameters.items()):
                if param is None or not param.is_floating_point() or param.dtype == dtype:
                    continue
                self.originals.append((owner, name, param))
                owner._parameters[name] = self.weights.copy_of(param)  # tied weights: one copy, both uses
        cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)

    def after(self, module, args, kwargs, output):
        for owner, name, param in self.originals:
            owner._parameters[name] = param
        self.originals = []
        return output


def _innermost(block: nn.Module) -> nn.Module:
    """The block inside an activation-checkpointing wrapper (whose eager recomputation must swap again)."""
    while True:
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is None:
            return block
        block = inner


def apply_compute_casts(
    model: nn.Module, adapter: DecoderAdapter, policy: PrecisionPolicy, compiled: bool = False
) -> None:
    """FSDP's mixed-precision casts without FSDP: per decoder block, then the root for the rest.

    The hooks run outside compiled code (``compiled``: the blocks' forwards are compiled, see
    meshtron.distributed.parallelize.apply_compile), so they never make dynamo guard on or recompile for
    a parameter. A compiled checkpointed block recomputes from the copies its compiled forward was given;
    an eager one runs its inner block again, whose hooks swap the same copies in again.
    """
    if policy.compute_dtype is None:
        return
    weights = ComputeWeights(policy.compute_dtype)
    object.__setattr__(model, COMPUTE_WEIGHTS_ATTRIBUTE, weights)  # not a submodule, not in the state dict
    blocks = [block if compiled else _innermost(block) for _, block in adapter.named_blocks(model)]
    for module, skip in [(block, []) for block in blocks] + [(model, blocks)]:
        hooks = _CastHooks(module, weights, skip)
        module.register_forward_pre_hook(hooks.before, with_kwargs=True)
        module.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)


def compute_weight(model: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The compute-dtype copy of ``model``'s parameter ``weight`` that its casts use this step, or ``weight``
    itself where ``model`` has no casts of its own (FSDP's policy, no mixed precision) or it is no parameter.

    For a head applied outside the model's forward (the loss): it computes with the copy the forward made
    (no second cast), and its gradient joins that copy's, as it does under FSDP (whose head weight is the
    compute-dtype parameter): a tied embedding's two gradients are summed in the compute dtype as FSDP sums
    them, and converted to the master dtype once.
    """
    weights = model.__dict__.get(COMPUTE_WEIGHTS_ATTRIBUTE)
    if weights is None or not isinstance(weight, nn.Parameter) or not weight.is_floating_point():
        return weight
    if weight.dtype == weights.dtype:
        return weight
    return weights.copy_of(weight)


def compute_head(model: nn.Module, adapter) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model``'s head (weight, bias or None; ``adapter``: its meshtron.models.adapter.DecoderAdapter) as a loss
    applies it after the forward: ``compute_weight``'s copies (a tied head's gradient joins the embedding's, as under
    FSDP)."""
    weight, bias = adapter.head_parameters(model)
    return compute_weight(model, weight), (compute_weight(model, bias) if bias is not None else None)


def release_compute_weights(*models: nn.Module) -> None:
    """Drop the compute-dtype weight copies of ``models`` (after a step's last backward)."""
    for model in models:
        for module in model.modules():
            weights = module.__dict__.get(COMPUTE_WEIGHTS_ATTRIBUTE)
            if weights is not None:
                weights.release()
