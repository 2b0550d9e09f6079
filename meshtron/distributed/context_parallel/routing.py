"""meshtron's attention for Hugging Face models, routed by the sequence's layout: document masks for packed
sequences on one device, context-parallel attention across the ``cp`` ranks.

The model's attention modules reach ``hf_attention`` through transformers' attention-function registry
(the adapter switches the model's ``attn_implementation`` to ``ATTENTION_NAME``); per-call information
travels in the ``sequence_layout`` keyword argument that transformers passes down to the attention function.
"""

from __future__ import annotations

from meshtron.distributed.context_parallel.hybrid import hybrid_attention
from meshtron.distributed.context_parallel.layout import SequenceLayout
from meshtron.distributed.context_parallel.ring import context_parallel_attention
from meshtron.distributed.context_parallel.ulysses import ulysses_attention
from meshtron.errors import MeshtronError
from meshtron.models.attention_kernels import document_attention

ATTENTION_NAME = "meshtron"
"""The name under which ``hf_attention`` is registered with transformers."""


def _single_device_attention(
    query,
    key,
    value,
    layout: SequenceLayout,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks=None,
):
    """Whole-sequence attention with the document mask (and the layer's sliding ``window``, soft cap and sinks), by
    the layout's kernel (``model.attention_kernel``; ``auto``: the device's, see ``attention_kernels``)."""
    return document_attention(
        query,
        key,
        value,
        layout.document_ids,
        scale,
        kernel=layout.document_kernel,
        cache=layout.attention_cache,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


def hf_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sequence_layout=None,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """A transformers attention function: ``query`` (B, H, L, D), ``key``/``value`` (B, Hkv, L, D) -> (B, L, H, D).
    ``sliding_window``: what the layer's attention module passes (Gemma 2/3, Qwen2/3: the window on sliding
    layers, None on full ones; Mistral, Phi-3, Starcoder2: ``config.sliding_window``); a query at index i then
    sees a key at index j only if i - j < sliding_window, as transformers' ``sliding_window_overlay``.
    ``softcap``: Gemma 2's ``attn_logit_softcapping`` (whole-sequence attention and Ulysses only: the tiles of ring,
    all-gather and hybrid do not cap); ``s_aux``: gpt-oss's per-head attention sinks (H,), this rank's heads under
    tensor parallelism. ``parallel.cp_method=hybrid``: ``hybrid.hybrid_attention``."""
    if sequence_layout is None:
        raise MeshtronError("meshtron attention was called without a sequence_layout; call the model through meshtron")
    if dropout:
        raise MeshtronError("attention dropout is not supported with document masking or context parallelism")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sequence_layout.cp == 1:
        out = _single_device_attention(query, key, value, sequence_layout, scale, sliding_window, softcap, s_aux)
    elif sequence_layout.method == "ulysses":
        out = ulysses_attention(query, key, value, sequence_layout, scale, sliding_window, softcap, s_aux)
    elif softcap:
        raise MeshtronError(
            f"soft-capped attention scores with parallel.cp_method={sequence_layout.method}: use parallel.cp_method="
            "ulysses"
        )
    elif sequence_layout.method == "hybrid":
        out = hybrid_attention(query, key, value, sequence_layout, scale, sliding_window, s_aux)
    else:
        out = context_parallel_attention(query, key, value, sequence_layout, scale, sliding_window, s_aux)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Make ``hf_attention`` known to transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    return ATTENTION_NAME
