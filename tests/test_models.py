"""Model construction: presets, meta-device build, layout-independent init, pretrained loading."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError, MeshtronError
from meshtron.models.build import build_meta_model, canonical_name, init_tensor, load_hf_config, materialize
from meshtron.models.presets import PRESETS, make_preset_config

CPU = torch.device("cpu")


def build(model_cfg: ModelConfig, seed: int = 0, vocab: int = 257):
    hf_config = load_hf_config(model_cfg, vocab)
    model, adapter = build_meta_model(hf_config, model_cfg)
    materialize(model, adapter, CPU, seed=seed, pretrained_dir=model_cfg.name_or_path)
    return model


@pytest.mark.parametrize("preset", [name for name in PRESETS if name.endswith("tiny")])
def test_tiny_presets_build_and_run(preset):
    model = build(ModelConfig(preset=preset))
    assert model.config.model_type == PRESETS[preset]["model_type"]
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.isfinite(model.model.rotary_emb.inv_freq).all()
    logits = model(input_ids=torch.randint(0, 257, (2, 8))).logits
    assert logits.shape == (2, 8, model.config.vocab_size) and torch.isfinite(logits).all()


def test_init_depends_on_seed_and_name_only():
    a, b, c = build(ModelConfig(preset="tiny"), seed=1), build(ModelConfig(preset="tiny"), seed=1), build(ModelConfig(preset="tiny"), seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - 0.02) < 0.005, name
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name
    q, k = a.model.layers[0].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(q, k)
    assert torch.equal(init_tensor("x.bias", torch.Size([3]), 0.02, 0), torch.zeros(3))


def test_vocab_is_padded_from_tokenizer():
    assert make_preset_config("tiny", 257).vocab_size == 320
    assert make_preset_config("llama-1b", 257).vocab_size == 128256


def test_unknown_preset():
    with pytest.raises(ConfigError, match="model.preset: unknown preset 'gpt-9'"):
        make_preset_config("gpt-9", 257)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("safe", [True, False])
def test_pretrained_directory_loads_exactly(tmp_path, tied, safe):
    from transformers import AutoModelForCausalLM

    config = make_preset_config("qwen2-tiny", 257)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config)
    original.save_pretrained(tmp_path, safe_serialization=safe)
    loaded = build(ModelConfig(name_or_path=str(tmp_path)))
    ref = original.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    ids = torch.randint(0, 257, (1, 12))
    torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


@pytest.mark.slow
def test_pretrained_load_under_fsdp_and_tp_reads_only_each_ranks_slice(tmp_path):
    """DP2 x TP2 (FSDP over tensor-parallel shards): the same weights and logits as one process,
    and no rank reads more than its share of the checkpoint (plus the replicated norms)."""
    import json

    from transformers import AutoModelForCausalLM

    from conftest import run_torchrun

    config = make_preset_config("qwen2-tiny", 257)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    out = tmp_path / "result.json"
    proc = run_torchrun(4, ["tests/sharded_load_worker.py", str(tmp_path / "model"), str(out),
                            "parallel.dp_shard=2", "parallel.tp=2"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["same_keys"]
    assert max(result["weight_diffs"].values()) == 0.0
    assert result["logits_diff"] < 1e-5
    # k/v projections are replicated over tp only when tp > KV heads; here tp=2 = KV heads, so every
    # matrix is split 4 ways and only the small norms and biases are read in full by FSDP's shard.
    assert result["max_read_fraction"] < 0.3, result["max_read_fraction"]
    print(f"max fraction of the checkpoint read by one rank: {result['max_read_fraction']:.4f}")


def test_pretrained_shape_mismatch_is_named(tmp_path):
    from transformers import AutoModelForCausalLM

    config = make_preset_config("llama-tiny", 257)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    config.intermediate_size = 96
    config.save_pretrained(tmp_path)
    with pytest.raises(MeshtronError, match="has shape .* but the config asks for"):
        build(ModelConfig(name_or_path=str(tmp_path)))


def test_tokenizer_larger_than_model_vocab(tmp_path):
    config = make_preset_config("llama-tiny", 257)
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="data.tokenizer has 1000 tokens"):
        load_hf_config(ModelConfig(name_or_path=str(tmp_path)), 1000)


def _tiny_with_dropout(checkpointing: str):
    from meshtron.distributed.parallelize import apply_activation_checkpointing

    model_cfg = ModelConfig(preset="llama-tiny")
    hf_config = load_hf_config(model_cfg, 257)
    hf_config.attention_dropout = 0.5  # functional dropout inside SDPA: no nn.Dropout module shows it
    model, adapter = build_meta_model(hf_config, model_cfg)
    apply_activation_checkpointing(model, adapter, checkpointing)
    materialize(model, adapter, CPU, seed=0)
    return model.train()


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_dropout_masks(checkpointing):
    """Gradients with checkpointing equal those without: the recomputed forward draws the forward's
    dropout masks again (the RNG state is saved and restored around it)."""
    input_ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("none", checkpointing):
        model = _tiny_with_dropout(mode)
        torch.manual_seed(123)
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        grads.append({canonical_name(name): p.grad.clone() for name, p in model.named_parameters()})
    reference, checkpointed = grads
    assert reference.keys() == checkpointed.keys()
    for name in reference:
        torch.testing.assert_close(checkpointed[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)


def test_materialize_puts_buffers_on_the_compute_device_and_parameters_where_asked():
    """fsdp.cpu_offload: parameters start on the CPU, rotary buffers on the compute device (here meta
    stands in for a GPU, which this machine lacks)."""
    model_cfg = ModelConfig(preset="llama-tiny")
    model, adapter = build_meta_model(load_hf_config(model_cfg, 257), model_cfg)
    materialize(model, adapter, CPU, seed=0, buffer_device=torch.device("meta"))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.device.type == "meta"
