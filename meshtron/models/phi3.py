"""Phi-3 (``Phi3ForCausalLM``, also Phi-3.5 and Phi-4): its fused projections, split for training.

Phi-3 computes q, k and v with one ``qkv_proj`` (rows: all query heads, then the key heads, then the value
heads) and the MLP's gate and up with one ``gate_up_proj`` (gate rows, then up rows). Tensor parallelism
splits a projection's rows in contiguous pieces, which for a fused matrix would hand a rank query rows of
some heads and key rows of others. So meshtron trains Phi-3 with the projections split, as Llama has them:
``self_attn.q_proj / k_proj / v_proj`` and ``mlp.gate_proj / up_proj``, always (whatever the layout, so
meshtron's own checkpoints have one set of names). The values are the same rows, and the forward the same
computation (one product per section instead of one over the concatenation: rounding may differ in the
last bit).

The Hugging Face checkpoint boundary keeps Phi-3's layout: pretrained weights are read as row ranges of the
fused tensors (``checkpoint_sources``: each rank still reads only its own rows), and ``meshtron export``
fuses the projections back (``fuse_projections``), so the exported model is a plain Phi-3.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from meshtron.models.adapter import DecoderAdapter

_ATTENTION_SECTIONS = ("q_proj", "k_proj", "v_proj")
_MLP_SECTIONS = ("gate_proj", "up_proj")


class SplitPhi3Attention(nn.Module):
    """Phi-3's attention with ``q_proj``, ``k_proj`` and ``v_proj`` in place of ``qkv_proj`` (same forward
    otherwise). Head counts come from the projections' outputs, so it also runs on a tensor-parallel
    rank's local heads."""

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        from transformers.models.phi3 import modeling_phi3 as phi3

        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = phi3.apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention = phi3.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, phi3.eager_attention_forward
        )
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=getattr(self.config, "sliding_window", None),
            **kwargs,
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class SplitPhi3MLP(nn.Module):
    """Phi-3's MLP with ``gate_proj`` and ``up_proj`` in place of ``gate_up_proj``: ``down(up * act(gate))``."""

    def forward(self, hidden_states):
        return self.down_proj(self.up_proj(hidden_states) * self.activation_fn(self.gate_proj(hidden_states)))


def _section_rows(config) -> dict[str, tuple[str, int, int]]:
    """Split name -> (fused name, first row, rows) within a block."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, kv_rows),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, kv_rows),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
    }


def _split(fused: nn.Linear, rows: list[int]) -> list[nn.Linear]:
    """Linears holding consecutive row ranges of ``fused`` (on its device: the meta device while building)."""
    pieces, start = [], 0
    for count in rows:
        piece = nn.Linear(
            fused.in_features, count, bias=fused.bias is not None, device=fused.weight.device, dtype=fused.weight.dtype
        )
        if fused.weight.device.type != "meta":
            piece.weight.data.copy_(fused.weight.data[start : start + count])
            if fused.bias is not None:
                piece.bias.data.copy_(fused.bias.data[start : start + count])
        pieces.append(piece)
        start += count
    return pieces


def _fuse(pieces: list[nn.Linear]) -> nn.Linear:
    first = pieces[0]
    fused = nn.Linear(
        first.in_features,
        sum(p.out_features for p in pieces),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in pieces]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in pieces]))
    return fused


@functools.cache
def _with_forward(split: type, original: type) -> type:
    """``original`` (transformers' module class) with ``split``'s forward; ``__bases__[1]`` gives it back."""
    return type(split.__name__, (split, original), {})


class Phi3Adapter(DecoderAdapter):
    """The shared decoder anatomy, with Phi-3's fused projections split (module docstring)."""

    def split_fused_projections(self, model: nn.Module) -> None:
        sections = _section_rows(model.config)
        for _, block in self.named_blocks(model):
            attention, mlp = block.self_attn, block.mlp
            if isinstance(attention, SplitPhi3Attention):
                continue
            rows = [sections[f"self_attn.{name}"][2] for name in _ATTENTION_SECTIONS]
            for name, piece in zip(_ATTENTION_SECTIONS, _split(attention.qkv_proj, rows)):
                setattr(attention, name, piece)
            del attention.qkv_proj
            attention.__class__ = _with_forward(SplitPhi3Attention, attention.__class__)
            rows = [sections[f"mlp.{name}"][2] for name in _MLP_SECTIONS]
            for name, piece in zip(_MLP_SECTIONS, _split(mlp.gate_up_proj, rows)):
                setattr(mlp, name, piece)
            del mlp.gate_up_proj
            mlp.__class__ = _with_forward(SplitPhi3MLP, mlp.__class__)

    def fuse_projections(self, model: nn.Module) -> None:
        for _, block in self.named_blocks(model):
            attention, mlp = block.self_attn, block.mlp
            if not isinstance(attention, SplitPhi3Attention):
                continue
            attention.qkv_proj = _fuse([getattr(attention, name) for name in _ATTENTION_SECTIONS])
            for name in _ATTENTION_SECTIONS:
                delattr(attention, name)
            attention.__class__ = type(attention).__bases__[1]
            mlp.gate_up_proj = _fuse([getattr(mlp, name) for name in _MLP_SECTIONS])
            for name in _MLP_SECTIONS:
                delattr(mlp, name)
            mlp.__class__ = type(mlp).__bases__[1]

    def checkpoint_sources(self, name: str, config) -> list[tuple[str, int | None]]:
        prefix, dot, leaf = name.rpartition(".")  # e.g. model.layers.3.self_attn.q_proj . weight
        for split, (fused, first_row, _) in _section_rows(config).items():
            if prefix.endswith("." + split):
                block = prefix[: -len(split)]
                return [(name, None), (f"{block}{fused}{dot}{leaf}", first_row)]
        return super().checkpoint_sources(name, config)
