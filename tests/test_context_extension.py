"""Context extension (model.max_position_embeddings, model.rope_scaling): settings, the Hugging Face config they make,
refusals, a run past the pretrained length, and an export that plain transformers loads with the same logits. Parity
of the layouts: cp2_yarn and pp2_yarn in test_parity.py."""

from __future__ import annotations

import pytest
import torch
from conftest import run_main

from meshtron.config import ModelConfig, load_config, to_toml
from meshtron.errors import ConfigError
from meshtron.models.context_extension import check_rope_layout, extend_context
from meshtron.models.presets import make_preset_config

YARN = '{"rope_type": "yarn", "factor": 4}'


def extended(preset: str, **settings):
    config = make_preset_config(preset, 257)
    extend_context(config, ModelConfig(preset=preset, **settings))
    return config


def test_rope_scaling_is_a_table_in_toml_and_json_on_the_command_line(tmp_path):
    cfg = load_config(None, [f"model.rope_scaling={YARN}", "model.max_position_embeddings=4096"], env={})
    assert cfg.model.rope_scaling == {"rope_type": "yarn", "factor": 4} and cfg.model.max_position_embeddings == 4096
    saved = tmp_path / "run.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(saved, env={}).model.rope_scaling == cfg.model.rope_scaling  # a run's config.toml loads back
    (tmp_path / "inline.toml").write_text('[model]\nrope_scaling = {rope_type = "linear", factor = 2.0}\n')
    assert load_config(tmp_path / "inline.toml", env={}).model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match=r"model.rope_scaling: expected table \(a JSON object on the command line\)"):
        load_config(None, ["model.rope_scaling=yarn"], env={})
    with pytest.raises(ConfigError, match="model.max_position_embeddings: must be a positive integer, got 0"):
        load_config(None, ["model.max_position_embeddings=0"], env={})


def test_a_factor_extends_the_positions_and_keeps_the_pretrained_length_where_the_rope_type_reads_it():
    config = extended("llama-tiny", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    pretrained = make_preset_config("llama-tiny", 257).max_position_embeddings
    assert config.max_position_embeddings == 4 * pretrained
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": pretrained,
    }
    # linear needs no pretrained length; an explicit model.max_position_embeddings wins over the factor's
    config = extended("llama-tiny", rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=1000)
    assert config.max_position_embeddings == 1000 and "original_max_position_embeddings" not in config.rope_parameters
    # a partial rotary factor (GPT-NeoX) is kept when the rope type changes
    assert extended("gptneox-tiny", rope_scaling={"rope_type": "linear", "factor": 2.0}).rope_parameters == {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "factor": 2.0,
    }


def test_models_with_a_rope_per_layer_type_scale_each_or_the_ones_named():
    both = extended("gemma3-tiny", rope_scaling={"rope_type": "linear", "factor": 8.0}).rope_parameters
    assert {entry["rope_type"] for entry in both.values()} == {"linear"}
    assert both["full_attention"]["rope_theta"] == 1e6 and both["sliding_attention"]["rope_theta"] == 1e4
    named = extended(
        "gemma3-tiny", rope_scaling={"full_attention": {"rope_type": "linear", "factor": 8.0}}
    ).rope_parameters  # as Gemma 3's long-context checkpoints: the global layers only
    assert named["full_attention"]["factor"] == 8.0 and named["sliding_attention"]["rope_type"] == "default"


@pytest.mark.parametrize(
    "preset, settings, expected",
    [
        ("llama-tiny", {"rope_type": "stretchy", "factor": 2}, "rope_type 'stretchy' is not one this transformers"),
        ("llama-tiny", {"rope_type": "linear"}, r"model.rope_scaling: Missing required keys .*\{'factor'\}"),
        ("llama-tiny", {"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1, got 0.5"),
        ("gpt2", {"rope_type": "linear", "factor": 2}, "model_type 'gpt2' has no rotary position embeddings"),
    ],
)
def test_rope_scaling_that_cannot_apply_is_refused_in_one_line(preset, settings, expected):
    if preset == "gpt2":  # learned positions: nothing to scale
        from transformers import GPT2Config

        config = GPT2Config(n_layer=1, n_embd=16, n_head=2)
        with pytest.raises(ConfigError, match=expected):
            extend_context(config, ModelConfig(rope_scaling=settings))
        return
    with pytest.raises(ConfigError, match=expected):
        extended(preset, rope_scaling=settings)


def test_longrope_past_its_pretrained_length_is_refused_where_it_would_depend_on_the_batch():
    config = extended(
        "phi3-tiny",
        rope_scaling={"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
    )
    pretrained = config.rope_parameters["original_max_position_embeddings"]
    check_rope_layout(config, pretrained, cp=2, mask_documents=True)  # within the pretrained length: always short
    check_rope_layout(config, 2 * pretrained, cp=1, mask_documents=False)  # every forward sees all positions
    for cp, masks in ((1, True), (2, False)):
        with pytest.raises(ConfigError, match="set data.mask_documents=false and parallel.cp=1"):
            check_rope_layout(config, 2 * pretrained, cp=cp, mask_documents=masks)


def test_a_run_past_the_pretrained_length_exports_a_model_that_transformers_loads_with_the_same_positions(
    tmp_path, cache_dir
):
    """A model pretrained at 16 positions trains at 48 with YaRN x4; the export carries the rope parameters and its
    logits at 48 tokens equal meshtron's model with the same weights (and differ without the scaling)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from meshtron.models.build import build_meta_model, load_hf_config, materialize

    short = tmp_path / "short"
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        vocab_size=257,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(short)
    common = [
        f"--model.name_or_path={short}",
        "--data.tokenizer=byte",
        "--data.seq_len=48",
        "--data.max_documents=40",
        f"--data.cache_dir={cache_dir}",
        "--train.steps=2",
        "--train.global_batch_size=2",
        "--run.progress=false",
    ]
    refused = run_main(["train", *common, f"--run.output_dir={tmp_path / 'refused'}"])
    assert refused.returncode == 2 and "or extend the model's context with model.rope_scaling" in refused.stderr
    run = tmp_path / "run"
    trained = run_main(
        ["train", *common, f"--model.rope_scaling={YARN}", "--checkpoint.interval=2", f"--run.output_dir={run}"]
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = tmp_path / "hf"
    assert run_main(["export", str(run / "checkpoints" / "step-00000002"), str(exported)]).returncode == 0

    theirs_model = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert theirs_model.config.max_position_embeddings == 64
    assert theirs_model.config.rope_parameters["rope_type"] == "yarn"
    weights = theirs_model.state_dict()
    ids = torch.randint(1, 250, (1, 48), generator=torch.Generator().manual_seed(0))

    def meshtron_logits(rope_scaling):
        model_cfg = ModelConfig(name_or_path=str(short), rope_scaling=rope_scaling, max_position_embeddings=64)
        model, adapter = build_meta_model(load_hf_config(model_cfg, 257), model_cfg)
        materialize(model, adapter, torch.device("cpu"), seed=0)
        model.load_state_dict(weights)
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits

    with torch.no_grad():
        theirs = theirs_model(ids).logits
    assert (meshtron_logits({"rope_type": "yarn", "factor": 4}) - theirs).abs().max().item() <= 1e-5
    assert (meshtron_logits({}) - theirs).abs().max().item() > 1e-4  # the positions are what the export carries


def test_the_planner_plans_and_emits_an_extended_model(tmp_path):
    emitted = tmp_path / "long.toml"
    args = ["plan", "--model", "llama-8b", "--gpus", "8", "--seq-len", "131072", "--global-batch", "8", "--top", "1"]
    refused = run_main(args)
    assert refused.returncode == 2 and "or extend the model's context with --rope-scaling" in refused.stderr
    planned = run_main([*args, "--rope-scaling", YARN.replace("4", "16"), "--emit-config", str(emitted)])
    assert planned.returncode == 0, planned.stderr[-2000:]
    cfg = load_config(emitted, env={})
    assert cfg.model.rope_scaling == {"rope_type": "yarn", "factor": 16} and cfg.data.seq_len == 131072
    from meshtron.models.build import check_seq_len, load_hf_config

    check_seq_len(load_hf_config(cfg.model, 257), cfg.data.seq_len)  # what meshtron train checks: accepted
