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
        (["lora.rank=4", "precision.float8=true"], "lora.rank > 0 with precision.float8 is not supported yet"),
        (["lora.rank=4", "optimizer.name=muon"], "lora.rank > 0 with optimizer.name=muon is not supported yet"),
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
    from meshtron.distributed.runtime import Runtime
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
            "optimizer.lr=1e-2",
            "schedule.warmup_steps=0",
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
    from meshtron.checkpoint.generate import generate_text

    # meshtron generate on the checkpoint, the merged export and the adapter (merged on its base by peft): one text.
    texts = {generate_text(str(source), "ab", max_new_tokens=8) for source in (checkpoint, merged, adapter_dir)}
    assert len(texts) == 1, texts
    from safetensors.torch import load_file

    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert set(saved) == {
        f"base_model.model.{name}" for name, p in result.model.named_parameters() if p.requires_grad
    } | {"base_model.model.lm_head.weight"}


def test_a_lora_checkpoint_resumes_only_on_its_base_and_with_lora():
    from pathlib import Path

    from meshtron.checkpoint.manager import LORA_BASE, check_lora_checkpoint, lora_base
    from meshtron.train.setup.run_setup import checkpoint_options

    def base(cfg):  # the run's LoRA base as the checks get it, None without LoRA
        return checkpoint_options(cfg).lora_base

    path = Path("step-00000004")
    lora = load_config(None, ["model.preset=llama-tiny", "lora.rank=4", "train.seed=3"], env={})
    meta = {LORA_BASE: lora_base(lora.model, lora.train.seed)}
    check_lora_checkpoint(meta, path, base(lora))  # its own base
    other_seed = load_config(None, ["model.preset=llama-tiny", "lora.rank=4", "train.seed=4"], env={})
    with pytest.raises(ConfigError, match="holds LoRA adapters of another base .*train.seed=3"):
        check_lora_checkpoint(meta, path, base(other_seed))
    with pytest.raises(ConfigError, match="holds only LoRA adapters"):
        check_lora_checkpoint(meta, path, base(load_config(None, ["model.preset=llama-tiny"], env={})))
    with pytest.raises(ConfigError, match="is of a run without LoRA; to fine-tune it with LoRA, export it"):
        check_lora_checkpoint({}, path, base(lora))


def test_an_adapter_exported_from_a_relative_base_path_loads_from_any_folder(tmp_path, cache_dir, monkeypatch):
    """A run given its base as a relative path (``model.name_or_path=base``), exported with ``export --adapter`` from
    that folder: peft's AutoPeftModelForCausalLM and ``meshtron generate`` load the adapter from another folder."""
    from conftest import run_main
    from peft import AutoPeftModelForCausalLM

    from meshtron.checkpoint.generate import generate_text

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    tiny_llama().save_pretrained(work / "base")
    monkeypatch.chdir(work)
    settings = ["--model.name_or_path=base", "--data.max_documents=8", "--data.seq_len=16", "--lora.rank=2"]
    settings += [f"--data.cache_dir={cache_dir}", "--train.steps=1", "--train.global_batch_size=2"]
    settings += ["--checkpoint.interval=1", "--run.progress=false", "--run.output_dir=run"]
    proc = run_main(["train", *settings])
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_main(["export", "run/checkpoints/step-00000001", "adapter", "--adapter"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((work / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(work / "base")
    assert load_config(work / "run" / "config.toml", env={}).model.name_or_path == str(work / "base")

    monkeypatch.chdir(elsewhere)
    model = AutoPeftModelForCausalLM.from_pretrained(str(work / "adapter"))
    assert model.peft_config["default"].r == 2
    assert generate_text(str(work / "adapter"), "ab", max_new_tokens=2)


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


def tiny_moe(preset: str = "qwen3moe-tiny"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_preset_config(preset, BYTE_VOCAB))


def _randomize_adapters(model) -> None:
    from meshtron.models.lora import is_lora_parameter

    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_parameter(name):  # B too, which starts at zero: the update must show
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("preset", ["qwen3moe-tiny", "gptoss-tiny"])
@pytest.mark.parametrize("use_grouped_mm, rank", [(True, 4), (False, 4), (True, 3)])
def test_expert_adapters_compute_the_merged_experts_in_both_kernels(use_grouped_mm, rank, preset):
    """Routed experts with adapters (both fused projections, per expert) equal transformers' experts with the
    weights W_e + (alpha / rank) B_e A_e, in the grouped GEMM and in the loop (where a rank of 3 fp32 columns,
    12 bytes, is too narrow for the grouped GEMM); every adapter gets its gradient. gpt-oss's experts are stored
    transposed ([E, in, out]): their adapters keep the [out, in] convention, the merged update is transposed."""
    import copy

    from meshtron.models.experts import local_experts_forward
    from meshtron.models.lora import expert_adapters

    model = tiny_moe(preset)
    transposed = preset == "gptoss-tiny"
    experts = copy.deepcopy(model.model.layers[0].mlp.experts)
    reference = copy.deepcopy(experts)
    targets = add_lora(model, adapter_for(model.config), LoraConfig(rank=rank, alpha=2 * rank, targets=["experts"]))
    assert targets == ["experts"]
    lora_experts = model.model.layers[0].mlp.experts
    assert lora_experts.lora_A.gate_up_proj.shape == (4, rank, 64)
    assert lora_experts.lora_B.down_proj.shape == (4, 64, rank)
    _randomize_adapters(model)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            update = torch.bmm(getattr(lora_experts.lora_B, name), getattr(lora_experts.lora_A, name))
            getattr(reference, name).add_(2.0 * (update.transpose(-2, -1) if transposed else update))
    hidden = torch.randn(11, 64)
    index = torch.randint(0, 3, (11, 2))  # expert 3 gets no token
    weights = torch.rand(11, 2)
    want = reference(hidden, index, weights)
    got = local_experts_forward(
        lora_experts, hidden, index, weights, use_grouped_mm, adapters=expert_adapters(lora_experts)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    grads = {name: p.grad for name, p in lora_experts.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(f"lora_{f}.{p}" for f in "AB" for p in ("gate_up_proj", "down_proj"))
    assert all(g is not None and g[:3].abs().sum() > 0 and g[3].abs().sum() == 0 for g in grads.values())


_ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]
_MLA = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]  # DeepSeek-V3's latent attention


@pytest.mark.parametrize(
    "preset, modules",
    [("qwen3moe-tiny", _ATTENTION), ("gptoss-tiny", _ATTENTION), ("deepseekv3-tiny", _MLA)],
)
def test_a_mixture_of_experts_exports_expert_adapters_that_peft_loads_with_the_merged_logits(tmp_path, preset, modules):
    """The experts' adapters go into the peft directory as target_parameters (peft's ParamWrapper layout); peft's
    model, meshtron's merged model and the LoRA model give the same logits (gpt-oss: transposed experts; DeepSeek-V3:
    latent attention's projections)."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshtron.checkpoint.lora_export import merge_adapters, write_peft_adapter

    base = tmp_path / "base"
    tiny_moe(preset).save_pretrained(base)
    model = tiny_moe(preset)
    lora = LoraConfig(rank=2, alpha=4, targets=["experts", *modules])
    targets = add_lora(model, adapter_for(model.config), lora)
    assert targets == ["experts", *modules]
    _randomize_adapters(model)
    write_peft_adapter(model, adapter_for(model.config), lora, targets, str(base), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == modules
    merged = copy.deepcopy(model)
    merge_adapters(merged)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.randint(0, BYTE_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert (want - AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("preset", ["qwen2moe-tiny", "deepseekv3-tiny"])
def test_a_peft_adapter_peft_would_misread_is_refused(tmp_path, preset):
    """peft reads gate_proj / up_proj / down_proj targets of these families as their experts' pre-fusion names, so
    the shared expert's (and DeepSeek-V3's dense layers') adapters would not be applied: refused with one line,
    nothing written."""
    from meshtron.checkpoint.lora_export import write_peft_adapter

    model = tiny_moe(preset)
    lora = LoraConfig(rank=2, alpha=4)
    targets = add_lora(model, adapter_for(model.config), lora)
    assert "gate_proj" in targets
    with pytest.raises(ConfigError, match="peft reads the .* targets down_proj, gate_proj, up_proj as its experts'"):
        write_peft_adapter(model, adapter_for(model.config), lora, targets, None, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_lora_flops_skip_the_frozen_weight_gradients_and_add_the_adapters():
    """flops_per_token's change under LoRA: -2 per frozen matmul weight (no weight gradient), +6 per adapter weight,
    routed experts at their top-k share; the planner's step time takes it (less compute than full fine-tuning)."""
    from meshtron.config import ModelConfig
    from meshtron.metrics.flops import lora_flops_per_token_change

    dense = make_preset_config("llama-tiny", BYTE_VOCAB)
    dense._attn_implementation = "eager"  # as a running model's (shared) config may say: left as it is
    lora = LoraConfig(rank=4)
    model = tiny_llama()
    linears = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))  # + head
    add_lora(model, adapter_for(model.config), lora)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_flops_per_token_change(dense, ModelConfig(), lora) == -2 * linears + 6 * adapters
    assert dense._attn_implementation == "eager"  # (building the counting model once switched a CP run to sdpa)
    assert lora_flops_per_token_change(dense, ModelConfig(), LoraConfig(rank=0)) == 0
    with_head = lora_flops_per_token_change(dense, ModelConfig(), LoraConfig(rank=4, train_head=True))
    assert with_head == -2 * (linears - model.lm_head.weight.numel()) + 6 * adapters

    moe = tiny_moe()  # 4 experts, top-2: the experts' weights and adapters count half
    routed = moe.config.num_experts_per_tok / moe.config.num_experts
    add_lora(moe, adapter_for(moe.config), LoraConfig(rank=4, targets=["experts"]))
    frozen = sum(
        p.numel() * (routed if p.ndim == 3 else 1)
        for n, p in moe.named_parameters()
        if p.ndim >= 2 and not p.requires_grad and "embed_tokens" not in n
    )
    adapters = sum(p.numel() * routed for p in moe.parameters() if p.requires_grad)
    assert lora_flops_per_token_change(moe.config, ModelConfig(), LoraConfig(rank=4, targets=["experts"])) == (
        -2 * frozen + 6 * adapters
    )


def test_the_planner_gives_a_lora_run_less_compute_than_full_fine_tuning():
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.throughput import estimate_step

    hf = make_preset_config("llama-1b", 128256)
    workload = Workload(seq_len=2048, global_batch=8)
    layout = Layout(ParallelDims(dp_shard=8), micro_batch=1)
    hw = hardware("h100")
    full = estimate_step(ModelShape.from_hf_config(hf), layout, workload, hw, hf)
    lora = estimate_step(ModelShape.from_hf_config(hf, lora=LoraConfig(rank=16)), layout, workload, hw, hf)
    assert 0.6 < lora.compute_s / full.compute_s < 0.75  # about 4 of 6 FLOPs per weight, plus attention
