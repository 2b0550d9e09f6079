"""What a model's attention is made of: documents of packed sequences, layer types and sliding windows, the
masks the model's own forward builds, and which settings meshtron's attention can honour.

Packed training blocks hold several documents, each ended by EOS. With document masking a token
attends only to earlier tokens of its own document and position ids restart at every document. For document
masks and context parallelism the model's attention is replaced by meshtron's (``hf_attention`` in
``distributed/context_parallel/routing.py``).

Without document masks and context parallelism the model keeps its own attention (sdpa, eager, ...):
also under pipeline parallelism, whose stages build the masks the model's forward would build
(``model_attention_masks``: causal and sliding-window causal, by layer type).
"""

from __future__ import annotations

import torch

from meshtron.errors import ConfigError, MeshtronError


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


def uses_meshtron_attention(cp: int, mask_documents: bool) -> bool:
    """Whether the model's attention must be replaced by ``hf_attention``: for document masks and context
    parallelism. Pipeline parallelism does not matter: stages that run the blocks themselves build the model's
    own masks (``model_attention_masks``)."""
    return cp > 1 or mask_documents


def layer_type(config, index: int) -> str:
    """The attention type of block ``index`` as the model's forward picks its mask: ``config.layer_types``
    (Gemma, Qwen2/3), else ``sliding_attention`` for a model with a ``sliding_window`` (Mistral, Phi-3,
    Starcoder2), else ``full_attention``."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def attention_windows(config) -> tuple[int | None, ...]:
    """The distinct sliding windows of the model's layers (None for full attention), as ``layer_type`` sees them."""
    window = getattr(config, "sliding_window", None)
    kinds = {layer_type(config, index) for index in range(config.num_hidden_layers)}
    return tuple(window if kind == "sliding_attention" else None for kind in sorted(kinds))


def model_attention_masks(config, hidden: torch.Tensor, position_ids: torch.Tensor, layer_types, **mask_kwargs) -> dict:
    """The attention masks the model's own forward builds for a training batch (no padding mask, no cache),
    for each of ``layer_types``: transformers' ``create_causal_mask`` for ``full_attention`` and
    ``create_sliding_window_causal_mask`` for ``sliding_attention``, for the model's attention implementation
    (None where sdpa's causal mode suffices, a float mask for eager). ``hidden`` stands for the input
    embeddings (batch, length, dtype and device are read from it); ``mask_kwargs[type]`` adds keyword
    arguments for one type's mask (Gemma 3's bidirectional overlays)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    common = {
        "config": config,
        "inputs_embeds": hidden,
        "attention_mask": None,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    masks = {}
    for kind in sorted(set(layer_types)):
        if kind not in makers:
            raise MeshtronError(f"layers of attention type '{kind}' are not supported by meshtron's pipeline stages")
        masks[kind] = makers[kind](**common, **mask_kwargs.get(kind, {}))
    return masks


def check_attention(
    hf_config, attn_implementation: str, cp: int, mask_documents: bool, cp_method: str = "ring"
) -> None:
    """Refuse settings meshtron's attention cannot honour, before any process-group work. (Sliding windows it
    keeps; pipeline stages without it build the model's own masks.)"""
    if not uses_meshtron_attention(cp, mask_documents):
        return
    from meshtron.models.families import family_of, resolve_attn_implementation

    attn_implementation = resolve_attn_implementation(attn_implementation, hf_config)
    needs = "parallel.cp > 1" if cp > 1 else "data.mask_documents"
    alternative = "" if cp > 1 else " or set data.mask_documents=false"
    # The settings that would keep the model's own attention (which has what meshtron's lacks).
    own = " and ".join(s for s, on in (("parallel.cp=1", cp > 1), ("data.mask_documents=false", mask_documents)) if on)
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    if softcap and cp > 1 and cp_method != "ulysses":
        raise ConfigError(
            f"the model's attn_logit_softcapping {softcap} is not supported by parallel.cp_method={cp_method} (its "
            "tiles do not cap scores); set parallel.cp_method=ulysses"
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ConfigError(
            f"the model attends bidirectionally (use_bidirectional_attention), and meshtron's attention (used for "
            f"{needs}) is causal; set {own}"
        )
    # A family sdpa cannot compute (soft caps, sinks) needs eager attention of its own; meshtron's replaces either.
    if attn_implementation != "sdpa" and not (family_of(hf_config).eager_only and attn_implementation == "eager"):
        raise ConfigError(
            f"model.attn_implementation={attn_implementation} cannot be combined with {needs} (meshtron's own "
            "attention replaces it); use model.attn_implementation=sdpa" + alternative
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ConfigError(
            f"the model's attention_dropout {hf_config.attention_dropout} is not supported with {needs}; "
            "set attention_dropout to 0 in the model config" + alternative
        )
