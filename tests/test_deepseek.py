"""DeepSeek-V3 (meshtron.models.deepseek, docs/moe.md): latent attention through meshtron's attention, checkpoints
with experts one by one and the router's own bias, training with the bias balancing by default, and export.

Under FSDP2, TP2, EP2, PP2, CP2 (ring and Ulysses) and EP2 x TP2 the loss trajectory, gradient norms, weights and
router biases equal one process: tests/test_parity.py (``*_deepseekv3``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import each_document_alone, two_step_run

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError
from meshtron.models.build import build_meta_model, load_hf_config, materialize
from meshtron.models.presets import make_preset_config

CPU = torch.device("cpu")
EOS = 0


def _build(model_cfg: ModelConfig, seed: int = 0):
    hf_config = load_hf_config(model_cfg, 257)
    model, adapter = build_meta_model(hf_config, model_cfg)
    materialize(model, adapter, CPU, seed=seed, pretrained_dir=model_cfg.name_or_path)
    return model


def _transformers_model(seed: int = 0):
    """transformers' own tiny DeepSeek-V3, with a router bias that changes the choice (as a trained one does)."""
    from transformers import AutoModelForCausalLM

    config = make_preset_config("deepseekv3-tiny", 257)
    config.eos_token_id = EOS
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.1)
    return model


def test_packed_documents_match_each_document_alone_through_transformers_eager_attention():
    """meshtron's attention (document masks) on MLA's query / key heads (24 wide) and narrower values (16): packed
    documents give the logits of each document run alone through transformers' eager attention."""
    from meshtron.distributed.context_parallel import register_attention
    from meshtron.train.batch import SequenceSplit, sequence_inputs

    model = _transformers_model()
    tokens = torch.randint(1, 257, (2, 40), generator=torch.Generator().manual_seed(3))
    tokens[0, [3, 17, 30]] = EOS
    with torch.no_grad():
        alone = each_document_alone(model, tokens, EOS)
        model.set_attn_implementation(register_attention())
        packed = model(**sequence_inputs(tokens, SequenceSplit(mask_documents=True, eos_token_id=EOS))).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_checkpoint_with_experts_one_by_one_and_the_router_bias_loads_exactly(tmp_path):
    """save_pretrained writes each expert's matrices apart and the router's e_score_correction_bias (a buffer):
    meshtron reads both, with transformers' own logits; a fresh model's bias starts at zero."""
    from safetensors import safe_open

    original = _transformers_model()
    original.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        saved = set(handle.keys())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in saved
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in saved
    loaded = _build(ModelConfig(name_or_path=str(tmp_path / "hf"))).eval()
    ref, got = original.state_dict(), loaded.state_dict()
    assert set(got) == set(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    # sdpa (meshtron's default) against the original's eager attention: equal to rounding.
    torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    fresh = _build(ModelConfig(preset="deepseekv3-tiny"))
    assert torch.equal(fresh.model.layers[1].mlp.gate.e_score_correction_bias, torch.zeros(8))


def test_trains_with_its_own_bias_balancing_and_exports_what_transformers_loads(tmp_path, cache_dir):
    """moe.router_balance=auto is DeepSeek-V3's own method: its routers' e_score_correction_bias moves with the
    expert load (no auxiliary loss); the export holds the experts one by one and the moved bias, and transformers
    loads it with the trained weights and logits."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from meshtron.checkpoint.export import export_checkpoint
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    cfg = two_step_run("model.preset=deepseekv3-tiny", tmp_path, cache_dir, "moe.router_bias_rate=0.01")
    result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=CPU))
    trained = result.model.state_dict()
    bias = trained["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() == pytest.approx(0.02)  # two steps of 0.01 against the load
    assert not any("balance_bias" in name for name in trained)
    export_checkpoint(str(tmp_path / "run" / "checkpoints" / "step-00000002"), str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        saved = set(handle.keys())
    assert {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "down_proj")} <= saved
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(state) == set(trained)
    for name, tensor in trained.items():  # every weight and the bias exactly: the same logits
        assert torch.equal(state[name], tensor), name


def test_balancing_and_router_loss_settings():
    """auto is bias for DeepSeek-V3 and the router loss for the other MoE families; DeepSeek-V3's sigmoid routers
    have no load-balancing loss in transformers, so asking for one is refused with one line."""
    from meshtron.train.moe.router_balance import resolve_router_balance
    from meshtron.train.moe.router_loss import router_loss_enabled

    deepseek, qwen = make_preset_config("deepseekv3-tiny", 257), make_preset_config("qwen3moe-tiny", 257)
    assert resolve_router_balance("auto", deepseek) == "bias"
    assert resolve_router_balance("auto", qwen) == "aux_loss"
    assert resolve_router_balance("aux_loss", deepseek) == "aux_loss"
    assert not router_loss_enabled("auto", deepseek)
    with pytest.raises(ConfigError, match="moe.router_aux_loss=true: deepseek_v3's routers score experts"):
        router_loss_enabled("true", deepseek)


def test_tensor_parallel_roles_and_planner_shape():
    """MLA's per-head up-projections are split by heads, its latents computed whole on every tp rank (the rope key's
    gradient summed); the planner counts the dense first layer apart from the MoE ones."""
    from meshtron.metrics.flops import flops_per_token
    from meshtron.models.adapter import adapter_for
    from meshtron.plan.model_shape import ModelShape

    config = make_preset_config("deepseekv3-tiny", 257)
    model, adapter = build_meta_model(config, ModelConfig(preset="deepseekv3-tiny"))
    roles = adapter_for(config).block_tp_roles(model.model.layers[1])
    assert roles["self_attn.q_b_proj"] == roles["self_attn.kv_b_proj"] == "colwise"
    assert roles["self_attn.q_a_proj"] == roles["self_attn.kv_a_layernorm"] == "replicated"
    assert roles["self_attn.kv_a_proj_with_mqa"] == "latent_rope"
    assert roles["mlp"] == "replicated_block"
    assert adapter_for(config).block_tp_roles(model.model.layers[0])["mlp.gate_proj"] == "colwise"  # dense layer
    shape = ModelShape.from_hf_config(config)
    assert shape.dense_layers == 1
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 4, 24)
    # FLOPs: 6 x the matmul weights a token uses (embeddings' lookup aside) + attention over 24 + 16 wide heads.
    expert = 3 * 64 * 32
    active = sum(p.numel() for n, p in model.named_parameters() if p.ndim > 1 and "embed" not in n)
    active -= 8 * expert - 2 * expert  # 2 of 8 routed experts per token
    attention = 2 * 2 * 32 * 4 * (24 + 16) / 2  # 2 layers, scores and values, causal half
    assert flops_per_token(config, 32) == pytest.approx(6 * active + 3 * attention)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=3"], "parallel.tp=3 does not divide the model's 4 attention heads"),
        (["moe.router_aux_loss=true"], "moe.router_aux_loss=true: deepseek_v3's routers"),
    ],
)
def test_refusals_name_the_setting(overrides, expected):
    from meshtron.config import load_config
    from meshtron.train.setup.preflight import preflight

    cfg = load_config(None, ["model.preset=deepseekv3-tiny", "data.seq_len=48", *overrides], env={})
    world = 3 if "parallel.tp=3" in overrides else 1
    with pytest.raises(ConfigError, match=expected):
        preflight(cfg, world, "cpu")


def test_float8_tensor_parallel_styles_leave_the_latents_alone():
    """With float8 linears everywhere (tensorwise), MLA's attention input is not cast for its column-parallel
    projections (the latents, computed whole, take it), the latents get no float8 TP style, and the per-head up- and
    output projections get torchao's float8 colwise / rowwise styles. (Float8 itself needs CUDA.)"""
    pytest.importorskip("torchao")
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from meshtron.distributed.tensor_parallel import _float8_styles
    from meshtron.models.adapter import adapter_for

    config = make_preset_config("deepseekv3-tiny", 257)
    model, _ = build_meta_model(config, ModelConfig(preset="deepseekv3-tiny"))
    block = model.model.layers[0]
    roles = adapter_for(config).block_tp_roles(block)
    linears = frozenset(path for path, module in block.named_modules() if isinstance(module, torch.nn.Linear))
    classes = _float8_styles(roles, linears)
    assert "self_attn" not in classes and "self_attn.q_a_proj" not in classes
    assert "self_attn.kv_a_proj_with_mqa" not in classes
    assert classes["self_attn.q_b_proj"] is classes["self_attn.kv_b_proj"] is Float8ColwiseParallel
    assert classes["self_attn.o_proj"] is Float8RowwiseParallel
    assert "mlp" in classes  # the dense layer's MLP: its input cast once for gate and up


def test_a_quantized_checkpoint_is_refused_before_it_is_read(tmp_path):
    """DeepSeek-V3's Hub checkpoint holds FP8 blocks with scales (gpt-oss's MXFP4): read as plain weights they would
    train a different model, so a config with a quantization_config is refused with one line."""
    import json

    config = make_preset_config("deepseekv3-tiny", 257)
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"holds quantized weights \(quant_method fp8\).*save_pretrained"):
        load_hf_config(ModelConfig(name_or_path=str(tmp_path)), 257)
