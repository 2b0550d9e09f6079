"""LoRA (docs/lora.md): adapters beside the blocks' projections, the base frozen, merged or peft exports.

Layout parity (DDP2, FSDP2, TP2, PP2, CP2, FSDP2 x TP2 against one process) is in test_parity.py."""

from __future__ import annotations

import json

import pytest
import torch

from meshtron.config import LoraConfig, load_config
from meshtron.errors import ConfigError
from meshtron.models.adapter import adapter_for
from meshtron.models.lora import LoraLinear, add_lora
from meshtron.models.presets import make_preset_config

BYTE_VOCAB = 257


def tiny_llama():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_preset_config("llama-tiny", BYTE_VOCAB))


def test_adapters_freeze_the_base_take_peft_names_and_start_from_the_base_model():
    model = tiny_llama()
    ids = torch.randint(0, BYTE_VOCAB, (2, 10))
    before = model(input_ids=ids).logits
    targets = add_lora(model, adapter_for(model.config), LoraConfig(rank=4, targets=["q_proj", "down_proj"]))
    assert targets == ["q_proj", "down_proj"]
    trainable = sorted(name for name, param in model.named_parameters() if param.requires_grad)
    assert trainable == sorted(
        f"model.layers.{layer}.{path}.lora_{part}.weight"
        for layer in (0, 1)
        for path in ("self_attn.q_proj", "mlp.down_proj")
        for part in "AB"
    )
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoraLinear) and q_proj.lora_A.weight.shape == (4, 64)
    for module in model.modules():
        if isinstance(module, LoraLinear):
            torch.nn.init.zeros_(module.lora_B.weight)  # as materialize starts them
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    head = add_lora(tiny_llama(), adapter_for(model.config), LoraConfig(rank=2, train_head=True))
    assert head == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["lora.rank=-1"], "lora.rank: must be >= 0"),
        (["lora.rank=4", "lora.alpha=0"], "lora.alpha: must be > 0"),
        (["lora.rank=4", "lora.dropout=1"], "lora.dropout: must be in [0, 1)"),
        (["lora.rank=4", "train.float8=true"], "lora.rank > 0 with train.float8 is not supported yet"),
        (["lora.rank=4", "train.optimizer=muon"], "lora.rank > 0 with train.optimizer=muon is not supported yet"),
        (["lora.rank=4", "parallel.ep=2"], "lora.rank > 0 with parallel.ep > 1 is not supported yet"),
    ],
)
def test_bad_lora_settings_are_one_line_errors(overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace(")", r"\)")) as err:
        load_config(None, overrides, env={})
    assert "\n" not in str(err.value)


def test_an_unknown_target_names_the_choices():
    model = tiny_llama()
    with pytest.raises(
        ConfigError, match="lora.targets: qkv is not a linear module of the model's blocks; choose from"
    ):
        add_lora(model, adapter_for(model.config), LoraConfig(rank=4, targets=["q_proj", "qkv"]))


def test_a_lora_run_exports_a_merged_model_and_a_peft_adapter_with_the_same_logits(tmp_path, cache_dir):
    """Fine-tune a saved Hugging Face model with LoRA (head trained too) for 3 steps, then export: the merged model
    and peft.PeftModel.from_pretrained(base, adapter) give the same logits (fp32, 1e-5), which are not the base's;
    the adapter directory holds only the adapters and the head."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshtron.checkpoint.export import export_checkpoint
    from meshtron.train.runtime import Runtime
    from meshtron.train.trainer import train

    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    cfg = load_config(
        None,
        [
            f"model.name_or_path={base}",
            "data.max_documents=20",
            "data.seq_len=32",
            f"data.cache_dir={cache_dir}",
            "train.steps=3",
            "train.global_batch_size=4",
            "train.lr=1e-2",
            "train.warmup_steps=0",
            "lora.rank=4",
            "lora.alpha=8",
            "lora.train_head=true",
            "checkpoint.interval=3",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        env={},
    )
    result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert result.state_bytes["grads"] == 4 * sum(p.numel() for p in result.model.parameters() if p.requires_grad)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    merged = export_checkpoint(str(checkpoint), str(tmp_path / "merged"))
    adapter_dir = export_checkpoint(str(checkpoint), str(tmp_path / "adapter"), adapter_only=True)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["modules_to_save"] == ["lm_head"]
    assert config["base_model_name_or_path"] == str(base)

    ids = torch.randint(0, BYTE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)
        peft_logits = peft_model(input_ids=ids).logits
    torch.testing.assert_close(peft_logits, merged_logits, rtol=1e-5, atol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the adapters (and head) trained
    from safetensors.torch import load_file

    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert set(saved) == {
        f"base_model.model.{name}" for name, p in result.model.named_parameters() if p.requires_grad
    } | {"base_model.model.lm_head.weight"}


def test_a_lora_checkpoint_resumes_only_on_its_base_and_with_lora():
    from pathlib import Path

    from meshtron.checkpoint.manager import LORA_BASE, check_lora_checkpoint, lora_base

    path = Path("step-00000004")
    lora = load_config(None, ["model.preset=llama-tiny", "lora.rank=4", "train.seed=3"], env={})
    meta = {LORA_BASE: lora_base(lora)}
    check_lora_checkpoint(meta, path, lora)  # its own base
    other_seed = load_config(None, ["model.preset=llama-tiny", "lora.rank=4", "train.seed=4"], env={})
    with pytest.raises(ConfigError, match="holds LoRA adapters of another base .*train.seed=3"):
        check_lora_checkpoint(meta, path, other_seed)
    with pytest.raises(ConfigError, match="holds only LoRA adapters"):
        check_lora_checkpoint(meta, path, load_config(None, ["model.preset=llama-tiny"], env={}))
    with pytest.raises(ConfigError, match="is of a run without LoRA; to fine-tune it with LoRA, export it"):
        check_lora_checkpoint({}, path, lora)


def test_the_peft_adapter_of_a_run_that_trains_the_embeddings_holds_them(tmp_path):
    """lora.train_embeddings: the embeddings go into the adapter as peft's modules_to_save, and peft loads them."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from meshtron.checkpoint.lora_export import write_peft_adapter

    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    model = tiny_llama()
    lora = LoraConfig(rank=2, targets=["q_proj"], train_embeddings=True)
    targets = add_lora(model, adapter_for(model.config), lora)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # "trained"
    write_peft_adapter(model, adapter_for(model.config), lora, targets, str(base), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["embed_tokens"]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.embed_tokens.weight" in saved
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    ids = torch.randint(0, BYTE_VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
