"""Exporting a LoRA run (meshtron.models.lora): the merged model, or a peft adapter directory.

``merge_adapters`` folds each adapter into its projection (``W + (alpha / rank) B A``) and leaves plain
``nn.Linear`` modules: the model then saves as any Hugging Face model. ``write_peft_adapter`` writes what
``peft.PeftModel.from_pretrained(base, DIR)`` loads: ``adapter_config.json`` (LoRA, the rank, alpha, dropout and
target module names; the trained embeddings / head as ``modules_to_save``) and ``adapter_model.safetensors`` with
peft's names (``base_model.model.<parameter name>``). A mixture of experts' expert adapters go in as peft's
``target_parameters`` (its ``ParamWrapper``: the gate_up_proj adapter the inner wrapper, ``base_layer``, the
down_proj one the outer; ``A`` as [E * r, in] expert-major, ``B`` as [out, r * E] expert-minor, as peft holds them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from meshtron.config import LoraConfig
from meshtron.errors import ConfigError
from meshtron.models.lora import (
    EXPERT_PROJECTIONS,
    EXPERTS,
    LORA_A,
    LORA_B,
    LoraLinear,
    has_expert_adapters,
    is_lora_parameter,
)
from meshtron.models.moe import experts_anatomy


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its projection's weight; the projections become plain ``nn.Linear`` again (and the
    experts plain experts)."""
    for module in model.modules():
        if has_expert_adapters(module):
            for name in EXPERT_PROJECTIONS:
                a, b = getattr(module.lora_A, name).float(), getattr(module.lora_B, name).float()
                weight, update = getattr(module, name), torch.bmm(b, a)  # [E, out, in]
                if experts_anatomy(module).transposed:  # gpt-oss's [E, in, out]
                    update = update.transpose(-2, -1)
                weight.add_((update * module.lora_scaling).to(weight.dtype))
            del module._modules[LORA_A], module._modules[LORA_B], module.lora_scaling, module.forward
        elif isinstance(module, LoraLinear):
            update = module.lora_B.weight.float() @ module.lora_A.weight.float()
            module.weight.add_((update * module.lora_scaling).to(module.weight.dtype))
            for child in (LORA_A, LORA_B, "lora_dropout"):
                del module._modules[child]
            del module.lora_scaling
            module.__class__ = nn.Linear


def write_peft_adapter(
    model: nn.Module,
    adapter,
    lora: LoraConfig,
    targets: list[str],
    base: str | None,
    target: Path,
    revision: str | None = None,
) -> None:
    """Write the adapters (and the trained embeddings / head) of ``model`` as a peft LoRA adapter in ``target``.
    ``base``: the base model's absolute path or hub id for ``base_model_name_or_path`` (None when trained from
    scratch); ``revision``: a hub id's commit, peft's ``revision``."""
    from safetensors.torch import save_file

    if adapter.fuses_projections:
        raise ConfigError(
            f"meshtron export --adapter: the {adapter.family} family fuses projections that meshtron trains apart "
            "(peft would not find them); export the merged model (without --adapter)"
        )
    _check_peft_reads_targets(model.config, targets)
    # Weights that trained whole (lora.train_embeddings / train_head) go in as peft's modules_to_save.
    whole = [name for name, param in model.named_parameters() if param.requires_grad and not is_lora_parameter(name)]
    experts = {path: module for path, module in model.named_modules() if has_expert_adapters(module)}
    tensors = {
        f"base_model.model.{name}": param.detach().contiguous()
        for name, param in model.named_parameters()
        if (is_lora_parameter(name) or name in whole) and name.rsplit(".", 2)[0] not in experts
    }
    for path, module in experts.items():
        tensors.update(_peft_expert_tensors(f"base_model.model.{path}", module))
    # peft matches a target parameter by the end of its name: the experts' path inside a block.
    target_parameters = sorted({_in_block(path) for path in experts})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "revision": revision,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if experts else lora.dropout,  # peft's expert adapters take none (at inference: moot)
        "target_modules": sorted(set(targets) - {EXPERTS}) or None,
        "target_parameters": [f"{p}.{name}" for p in target_parameters for name in EXPERT_PROJECTIONS] or None,
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


_PEFT_EXPERT_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})
"""Names peft (0.21) takes for a mixture of experts' pre-fusion expert projections in the families whose checkpoints
transformers 5 converts (Mixtral, Qwen2-MoE, DeepSeek-V3, ...)."""


def _check_peft_reads_targets(hf_config, targets: list[str]) -> None:
    """Refuse an adapter peft would load into other modules: for an MoE family whose checkpoints transformers 5
    converts, peft reads ``gate_proj`` / ``up_proj`` / ``down_proj`` (``w1`` / ``w2`` / ``w3``) targets as the experts'
    pre-fusion names, moves them to the fused experts and drops them as modules, so the adapters of a dense MLP or
    shared expert of those names (Qwen2-MoE's shared expert, DeepSeek-V3's dense layers and shared experts) would not
    be applied."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from meshtron.models.moe import is_moe

    clashing = sorted(_PEFT_EXPERT_NAMES & set(targets))
    model_type = getattr(hf_config, "model_type", None)
    if clashing and is_moe(hf_config) and get_checkpoint_conversion_mapping(model_type) is not None:
        raise ConfigError(
            f"meshtron export --adapter: peft reads the {model_type} targets {', '.join(clashing)} as its experts' "
            "pre-fusion names and would not apply these adapters to the modules that have them; export the merged "
            "model (without --adapter), or train with lora.targets leaving them out"
        )


def _in_block(path: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``mlp.experts``."""
    return path.split(".layers.", 1)[1].split(".", 1)[1]


def _peft_expert_tensors(prefix: str, experts: nn.Module) -> dict[str, torch.Tensor]:
    """peft's nested ParamWrapper tensors of one experts module: the first projection innermost (``base_layer``)."""
    out = {}
    for depth, name in zip((1, 0), EXPERT_PROJECTIONS):
        a, b = getattr(experts.lora_A, name).detach(), getattr(experts.lora_B, name).detach()
        num, rank, in_features = a.shape
        where = prefix + ".base_layer" * depth
        out[f"{where}.{LORA_A}.weight"] = a.reshape(num * rank, in_features).contiguous()
        out[f"{where}.{LORA_B}.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * num).contiguous()
    return out
