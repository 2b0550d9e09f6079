"""Exporting a LoRA run (meshtron.models.lora): the merged model, or a peft adapter directory.

``merge_adapters`` folds each adapter into its projection (``W + (alpha / rank) B A``) and leaves plain
``nn.Linear`` modules: the model then saves as any Hugging Face model. ``write_peft_adapter`` writes what
``peft.PeftModel.from_pretrained(base, DIR)`` loads: ``adapter_config.json`` (LoRA, the rank, alpha, dropout and
target module names; the trained embeddings / head as ``modules_to_save``) and ``adapter_model.safetensors`` with
peft's names (``base_model.model.<parameter name>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from meshtron.config import LoraConfig
from meshtron.errors import ConfigError
from meshtron.models.lora import LORA_A, LORA_B, LoraLinear, is_lora_parameter


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its projection's weight; the projections become plain ``nn.Linear`` again."""
    for module in model.modules():
        if isinstance(module, LoraLinear):
            update = module.lora_B.weight.float() @ module.lora_A.weight.float()
            module.weight.add_((update * module.lora_scaling).to(module.weight.dtype))
            for child in (LORA_A, LORA_B, "lora_dropout"):
                del module._modules[child]
            del module.lora_scaling
            module.__class__ = nn.Linear


def write_peft_adapter(
    model: nn.Module, adapter, lora: LoraConfig, targets: list[str], base: str | None, target: Path
) -> None:
    """Write the adapters (and the trained embeddings / head) of ``model`` as a peft LoRA adapter in ``target``.
    ``base``: the base model's path or hub name for ``base_model_name_or_path`` (None when trained from scratch)."""
    from safetensors.torch import save_file

    if adapter.fuses_projections:
        raise ConfigError(
            f"meshtron export --adapter: the {adapter.family} family fuses projections that meshtron trains apart "
            "(peft would not find them); export the merged model (without --adapter)"
        )
    # Weights that trained whole (lora.train_embeddings / train_head) go in as peft's modules_to_save.
    whole = [name for name, param in model.named_parameters() if param.requires_grad and not is_lora_parameter(name)]
    tensors = {
        f"base_model.model.{name}": param.detach().contiguous()
        for name, param in model.named_parameters()
        if is_lora_parameter(name) or name in whole
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(targets),
        "modules_to_save": sorted({name.rsplit(".", 2)[-2] for name in whole}) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
    }
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2))
