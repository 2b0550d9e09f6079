"""Activation checkpointing (``train.activation_checkpointing``): each decoder block keeps only its input for
backward and recomputes its forward there, whole (``full``) or all but its matmuls and attention (``selective``).
Applied by meshtron.distributed.parallelize after context parallel and before compile and FSDP.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshtron.models.adapter import DecoderAdapter

# Selective checkpointing keeps the outputs of these (expensive) ops and recomputes the rest.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.higher_order.flex_attention,  # meshtron's CUDA document-masked attention
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# Profiler annotations are no tensor computation. FSDP's hooks emit them a different number of times in a block's
# recomputation than in its forward (a nested FSDP module, an expert-parallel MoE layer's experts, runs FSDP's root
# pre-forward in the recomputation), which torch 2.13's selective checkpointing, counting every operator's
# invocations, takes for a nondeterministic region and fails on ("invocation index ... not found in storage"; fixed
# upstream by pytorch/pytorch#196862, not in torch 2.13). They bypass its bookkeeping here.
_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _selective_contexts():
    """Selective checkpointing's (forward, recomputation) dispatch modes, with profiler annotations passed through."""
    modes = create_selective_checkpoint_contexts(_selective_policy)
    for mode in modes:
        mode.__class__ = _without_profiler_ops(mode.__class__)
    return modes


@functools.cache
def _without_profiler_ops(mode_class: Any) -> type:
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PROFILER_OPS:
            return func(*args, **(kwargs or {}))
        return mode_class.__torch_dispatch__(self, func, types, args, kwargs)

    return type(mode_class.__name__, (mode_class,), {"__torch_dispatch__": __torch_dispatch__})


DROPOUT_CONFIG_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "mlp_dropout",
)
"""Hugging Face config fields that set a dropout probability (attention dropout is a functional call
inside the attention kernel, so no ``nn.Dropout`` module shows it)."""


def uses_dropout(model: nn.Module) -> bool:
    """Whether training draws random numbers in the model: an ``nn.Dropout`` with p > 0 or a dropout
    probability in its config."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return any(float(getattr(config, key, 0.0) or 0.0) > 0 for key in DROPOUT_CONFIG_KEYS)


def apply_activation_checkpointing(model: nn.Module, adapter: DecoderAdapter, mode: str) -> None:
    """Wrap each decoder block: ``full`` recomputes the whole block in backward, ``selective`` all but
    matmuls/attention.

    With dropout the recomputation must draw the forward's dropout masks again, so the RNG state is
    saved and restored around it; without, that bookkeeping is skipped.
    """
    if mode == "none":
        return
    preserve_rng_state = uses_dropout(model)
    for name, block in adapter.named_blocks(model):
        if mode == "full":
            adapter.replace_block(model, name, checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state))
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state, context_fn=_selective_contexts)
            adapter.replace_block(model, name, wrapped)
