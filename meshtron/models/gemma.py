"""Gemma 2 and Gemma 3 (``gemma2``, ``gemma3_text``): what their pipeline stages need beyond the shared anatomy.

``Gemma2Model`` / ``Gemma3TextModel.forward`` give every block the mask and (Gemma 3) the rotary embeddings
of its layer type, ``config.layer_types[i]`` (``sliding_attention``: a causal mask limited to
``config.sliding_window`` tokens and, in Gemma 3, the local rope base; ``full_attention``: the plain causal
mask and the global rope base). ``DecoderAdapter.run_stage`` builds the masks per layer type; this adapter
adds Gemma 3's per-type rotary embeddings (``rotary_emb(x, position_ids, layer_type)``) and its bidirectional
mask overlays when ``use_bidirectional_attention`` is set. The embedding scaling (``sqrt(hidden_size)``)
lives in the embedding module, so ``embed`` needs nothing more.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.models.adapter import DecoderAdapter


def _bidirectional_overlays(config) -> dict[str, dict]:
    """Gemma 3's extra mask functions for ``use_bidirectional_attention`` (as ``Gemma3TextModel.forward``)."""
    if config.model_type != "gemma3_text" or not getattr(config, "use_bidirectional_attention", False):
        return {}
    from transformers.models.gemma3.modeling_gemma3 import _bidirectional_window_overlay

    return {
        "full_attention": {"or_mask_function": lambda *args: torch.tensor(True, dtype=torch.bool)},
        "sliding_attention": {"or_mask_function": _bidirectional_window_overlay(config.sliding_window)},
    }


class GemmaAdapter(DecoderAdapter):
    def rotary_embeddings(self, model: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, kinds) -> dict:
        rotary = self.body(model).rotary_emb
        if self.family != "gemma3_text":
            return super().rotary_embeddings(model, hidden, positions, kinds)
        return {kind: rotary(hidden, positions, kind) for kind in sorted(set(kinds))}  # a rope base per layer type

    def mask_overlays(self, config) -> dict[str, dict]:
        return _bidirectional_overlays(config)
