"""Model-family adapters: the only place that knows where a model keeps its parts.

Parallelism code asks an adapter for the embeddings, decoder blocks, final norm and head; it never
reaches into a model's internals itself. Llama, Qwen2, Qwen3 and Mistral share one anatomy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtron.errors import MeshtronError

# Wrappers that parallelism adds around modules; they are not part of a parameter's real name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name as in the model's own state dict, without wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class DecoderAdapter:
    """Anatomy of a ``XForCausalLM`` whose body lives at ``.model`` with ``layers``, ``embed_tokens``, ``norm``."""

    family: str

    def body(self, model: nn.Module) -> nn.Module:
        return model.model

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return self.body(model).layers

    def embeddings(self, model: nn.Module) -> nn.Module:
        return self.body(model).embed_tokens

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.body(model).norm

    def lm_head(self, model: nn.Module) -> nn.Module:
        return model.lm_head

    def check_anatomy(self, model: nn.Module) -> None:
        try:
            parts = (self.blocks(model), self.embeddings(model), self.final_norm(model), self.lm_head(model))
        except AttributeError as err:
            raise MeshtronError(
                f"model family '{self.family}' does not have the decoder layout meshtron supports ({err}); "
                "use a Llama, Qwen2, Qwen3 or Mistral model"
            ) from None
        if not isinstance(parts[0], nn.ModuleList):
            raise MeshtronError(f"model family '{self.family}': decoder blocks are not an nn.ModuleList")

    @torch.no_grad()
    def init_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute non-persistent buffers (rotary ``inv_freq``) after the model left the meta device."""
        for module in model.modules():
            if hasattr(module, "inv_freq") and hasattr(module, "config"):
                fresh = type(module)(config=module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(device))
                if hasattr(fresh, "attention_scaling"):
                    module.attention_scaling = fresh.attention_scaling


ADAPTERS: dict[str, DecoderAdapter] = {
    family: DecoderAdapter(family) for family in ("llama", "qwen2", "qwen3", "mistral")
}


def adapter_for(config) -> DecoderAdapter:
    """The adapter of a Hugging Face config's family; other families get the shared one if their anatomy fits."""
    return ADAPTERS.get(config.model_type, DecoderAdapter(config.model_type))
