"""GPT-NeoX anatomy (``GPTNeoXForCausalLM``): body at ``.gpt_neox`` with ``embed_in``, ``layers``,
``final_layer_norm`` and ``rotary_emb``; attention at ``block.attention``; biased linears, LayerNorms and,
with ``use_parallel_residual``, attention and MLP side by side (done by the blocks).

The fused ``query_key_value`` holds, head after head, that head's q, k and v rows: a column-parallel split
of its rows in contiguous pieces gives each tensor-parallel rank whole heads (the attention reshapes its
output to ``(-1 heads, 3 x head size)``, so it runs on the local heads unchanged). GPT-NeoX has no GQA.

The head is ``lm_head`` in transformers 5; checkpoints call it ``embed_out`` (``checkpoint_sources``).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.models.adapter import DecoderAdapter

# Roles of the parts outside the blocks (paths relative to the whole model).
TOP_TP_ROLES = {"gpt_neox.embed_in": "embedding", "gpt_neox.final_layer_norm": "norm", "lm_head": "head"}
BLOCK_TP_ROLES = {
    "input_layernorm": "norm",
    "attention": "attention_positional",  # the block passes the hidden states positionally
    "attention.query_key_value": "colwise",
    "attention.dense": "rowwise",
    "post_attention_layernorm": "norm",
    "mlp": "mlp",
    "mlp.dense_h_to_4h": "colwise",
    "mlp.dense_4h_to_h": "rowwise",
}


class GPTNeoXAdapter(DecoderAdapter):
    def body(self, model: nn.Module) -> nn.Module:
        return model.gpt_neox

    def keep_stage(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        body = self.body(model)
        blocks = body.layers
        body.layers = nn.ModuleDict({str(i): blocks[i] for i in layers})
        if not first:
            body.embed_in = None
        if not last:
            body.final_layer_norm = None
            model.lm_head = None

    def embedding_name(self) -> str:
        return "gpt_neox.embed_in.weight"

    def checkpoint_sources(self, name: str, config) -> list[tuple[str, int | None]]:
        sources = super().checkpoint_sources(name, config)
        return sources + [("embed_out.weight", None)] if name == "lm_head.weight" else sources

    def embed(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        body = self.body(model)
        return body.emb_dropout(body.embed_in(input_ids))

    def embeddings(self, model: nn.Module) -> nn.Module:
        return self.body(model).embed_in

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.body(model).final_layer_norm

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [block.attention for _, block in self.named_blocks(model)]

    def block_tp_roles(self, block: nn.Module) -> dict[str, str]:
        present = {name for name, _ in block.named_modules()}
        return {path: role for path, role in BLOCK_TP_ROLES.items() if path in present}

    def top_tp_roles(self, model: nn.Module) -> dict[str, str]:
        present = {name for name, _ in model.named_modules()}
        return {path: role for path, role in TOP_TP_ROLES.items() if path in present}
