"""Config loading: TOML, env-var degrees, CLI overrides, precedence, validation, round trip."""

from __future__ import annotations

import pytest

from meshtron.config import Config, load_config, save_config, to_dict
from meshtron.errors import ConfigError


def test_defaults_are_valid():
    cfg = load_config(env={})
    assert cfg.parallel.dp_shard == -1 and cfg.optimizer.max_grad_norm == 1.0 and cfg.data.tokenizer == "auto"


def test_precedence_toml_env_cli(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[train]\nsteps = 5\n[optimizer]\nlr = 1\n[parallel]\ndp_shard = 2\ntp = 1\n[model]\npreset = "qwen3-tiny"\n'
    )
    cfg = load_config(toml, ["optimizer.lr=0.5", "--parallel.tp=1"], env={"DP_SIZE": "4"})
    assert cfg.train.steps == 5
    assert cfg.optimizer.lr == 0.5 and isinstance(cfg.optimizer.lr, float)  # TOML int promoted, then CLI wins
    assert cfg.parallel.dp_shard == 4  # env beats TOML
    assert cfg.model.preset == "qwen3-tiny"
    cfg = load_config(toml, ["parallel.dp_shard=8"], env={"DP_SIZE": "4"})
    assert cfg.parallel.dp_shard == 8  # CLI beats env
    assert load_config(toml, env={"EP_SIZE": "2"}).parallel.ep == 2  # expert parallelism, as the other degrees


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'"),
        ("trainer.steps=3", "unknown config key 'trainer.steps'"),
        ("train.steps=abc", "train.steps: expected int"),
        ("train.compile=maybe", "train.compile: 'maybe' is not one of auto, true, false"),
        ("precision.mixed_precision=fp8", "precision.mixed_precision: 'fp8' is not one of"),
        (
            "precision.float8_recipe=blockwise",
            "precision.float8_recipe: 'blockwise' is not one of tensorwise, rowwise, rowwise_with_gw_hp",
        ),
        ("run.device=tpu", "run.device: 'tpu' is not one of auto, cpu, cuda"),
        ("fsdp.param_dtype=bfloat16", "fsdp.param_dtype is no longer a setting; use precision.mixed_precision"),
        ("optimizer.lr=fast", "optimizer.lr: expected float"),
        ("model.dtype=float64", "model.dtype: 'float64' is not one of"),
        ("train.activation_checkpointing=some", "train.activation_checkpointing"),
        ("train.steps=0", "train.steps: must be a positive integer"),
        ("parallel.dp_shard=0", "parallel.dp_shard: must be a positive integer"),
    ],
)
def test_bad_overrides_name_the_setting(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [override], env={})


def test_bad_toml_type_and_unknown_section(tmp_path):
    bad_type = tmp_path / "a.toml"
    bad_type.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="train.steps: expected int, got 'ten'"):
        load_config(bad_type, env={})
    unknown = tmp_path / "b.toml"
    unknown.write_text("[optimiser]\nlr = 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'optimiser.lr'"):
        load_config(unknown, env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", env={})


def test_bool_and_optional_parsing():
    cfg = load_config(None, ["train.compile=true", "train.micro_batch_size=2", "fsdp.reduce_dtype=none"], env={})
    assert cfg.train.compile == "true" and cfg.train.micro_batch_size == 2 and cfg.fsdp.reduce_dtype is None
    cfg = load_config(None, ["train.micro_batch_size=none", "train.compile=0"], env={})
    assert cfg.train.micro_batch_size is None and cfg.train.compile == "false"


def test_toml_booleans_for_auto_settings(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\ncompile = true\n")
    assert load_config(path, env={}).train.compile == "true"
    path.write_text("[train]\ncompile = false\n")
    assert load_config(path, env={}).train.compile == "false"


def test_env_degrees():
    cfg = load_config(None, env={"TP_SIZE": "1", "DP_SIZE": "3", "CP_SIZE": "1", "PP_SIZE": "1"})
    assert cfg.parallel.dp_shard == 3
    with pytest.raises(ConfigError, match="parallel.tp: expected int"):
        load_config(None, env={"TP_SIZE": "two"})


def test_preset_and_path_are_exclusive():
    with pytest.raises(ConfigError, match="only one of model.name_or_path and model.preset"):
        load_config(None, ["model.preset=tiny", "model.name_or_path=/x"], env={})


def test_round_trip(tmp_path):
    cfg = load_config(None, ["train.steps=7", "data.seq_len=64", "run.output_dir=out"], env={})
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml", env={})
    assert to_dict(again) == to_dict(cfg)
    assert to_dict(again) != to_dict(Config())
