"""meshtron's attention for Hugging Face models: document masks for packed sequences and context parallelism.

Packed training blocks hold several documents, each ended by EOS. With document masking a token
attends only to earlier tokens of its own document and position ids restart at every document. The
model's attention modules reach ``hf_attention`` through transformers' attention-function registry
(the adapter switches the model's ``attn_implementation``); per-call information travels in the
``sequence_layout`` keyword argument that transformers passes down to the attention function.
"""

from __future__ import annotations

import torch

from meshtron.distributed.context_parallel import SequenceLayout, context_parallel_attention
from meshtron.errors import ConfigError, MeshtronError
from meshtron.models.attention_kernels import document_attention

ATTENTION_NAME = "meshtron"
"""The name under which ``hf_attention`` is registered with transformers."""


def document_ids(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, S) index of the document each token belongs to; a document ends with (and includes) its EOS."""
    is_eos = (input_ids == eos_token_id).to(torch.int64)
    return torch.cumsum(is_eos, dim=1) - is_eos


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) position of each token within its document (restarting at 0 for every document)."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def uses_meshtron_attention(cp: int, mask_documents: bool, pp: int = 1) -> bool:
    """Whether the model's attention must be replaced by ``hf_attention`` (pipeline stages, which run the
    blocks without the model's own mask construction, use it for the plain causal mask too)."""
    return cp > 1 or mask_documents or pp > 1


def check_attention(
    hf_config, attn_implementation: str, cp: int, mask_documents: bool, seq_len: int, pp: int = 1
) -> None:
    """Refuse settings meshtron's attention cannot honour, before any process-group work."""
    if not uses_meshtron_attention(cp, mask_documents, pp):
        return
    needs = "parallel.cp > 1" if cp > 1 else "parallel.pp > 1" if pp > 1 else "data.mask_documents"
    alternative = "" if cp > 1 or pp > 1 else " or set data.mask_documents=false"
    # The settings that would keep the model's own attention (which has what meshtron's lacks).
    own = " and ".join(s for s, on in (("parallel.cp=1", cp > 1), ("parallel.pp=1", pp > 1),
                                        ("data.mask_documents=false", mask_documents)) if on)
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None) or []
    if layer_types:  # per-layer attention types (Gemma, Qwen2): sliding if any layer is
        sliding = "sliding_attention" in layer_types
    else:  # Mistral has no switch; Qwen2-style configs turn the window off with use_sliding_window=false
        sliding = getattr(hf_config, "use_sliding_window", None) is not False
    if window and sliding and window < seq_len:
        raise ConfigError(
            f"the model's sliding_window {window} is shorter than data.seq_len {seq_len}, and meshtron's attention "
            f"(used for {needs}) has no sliding window; use data.seq_len <= {window} or set {own}"
        )
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    if softcap:
        raise ConfigError(
            f"the model's attn_logit_softcapping {softcap} is not supported by meshtron's attention (used for {needs}); "
            f"set {own}"
        )
    if attn_implementation != "sdpa":
        raise ConfigError(
            f"model.attn_implementation={attn_implementation} cannot be combined with {needs} (meshtron's own "
            "attention replaces it); use model.attn_implementation=sdpa"
            + alternative
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ConfigError(
            f"the model's attention_dropout {hf_config.attention_dropout} is not supported with {needs}; "
            "set attention_dropout to 0 in the model config" + alternative
        )


def _single_device_attention(query, key, value, layout: SequenceLayout, scale: float) -> torch.Tensor:
    """Whole-sequence attention with the document mask, by the device's kernel (see ``attention_kernels``)."""
    return document_attention(query, key, value, layout.document_ids, scale, cache=layout.attention_cache)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sequence_layout=None, **kwargs):
    """A transformers attention function: ``query`` (B, H, L, D), ``key``/``value`` (B, Hkv, L, D) -> (B, L, H, D)."""
    if sequence_layout is None:
        raise MeshtronError("meshtron attention was called without a sequence_layout; call the model through meshtron")
    if dropout:
        raise MeshtronError("attention dropout is not supported with document masking or context parallelism")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sequence_layout.cp == 1:
        out = _single_device_attention(query, key, value, sequence_layout, scale)
    else:
        out = context_parallel_attention(query, key, value, sequence_layout, scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Make ``hf_attention`` known to transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    return ATTENTION_NAME
