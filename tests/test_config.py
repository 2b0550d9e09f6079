"""Config loading: TOML, env-var degrees, CLI overrides, precedence, validation, round trip."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings

import pytest
import tomli_w

from meshtron import config
from meshtron.config import (
    DEPRECATED_KEYS,
    Config,
    load_config,
    parse_overrides,
    resolve_config,
    save_config,
    to_dict,
    validate_config,
)
from meshtron.errors import ConfigError
from meshtron.train.optim.muon import MuonSettings


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


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.stepz=3", "train.steps"),  # a near miss in its section
        ("trian.steps=3", "train.steps"),  # a near miss of the section
        ("trainer.steps=3", "train.steps"),
        ("train.seq_len=64", "data.seq_len"),  # a key of another section
        ("model.seqlen=64", "data.seq_len"),  # a near miss of a key of another section
        ("train.optimiser=muon", "optimizer.name"),  # an old key's near miss: its new key
        ("run.outputdir=x", "run.output_dir"),
    ],
)
def test_unknown_key_on_the_command_line_suggests_the_nearest(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override], env={})
    key = override.partition("=")[0]
    assert str(err.value).startswith(f"unknown config key '{key}'; did you mean {suggestion}? ")
    assert "\n" not in str(err.value)


def test_a_bare_key_on_the_command_line_suggests_its_section():
    with pytest.raises(ConfigError) as err:
        parse_overrides(["--steps=5"], "meshtron train ...")
    assert str(err.value).startswith("unexpected argument '--steps=5'; did you mean --train.steps? settings look like")
    with pytest.raises(ConfigError) as err:
        parse_overrides(["--frobnicate"], "meshtron train ...")
    assert "did you mean" not in str(err.value)


def test_unknown_key_with_nothing_near_guesses_nothing():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.xyz=1"], env={})
    assert "did you mean" not in str(err.value) and "valid keys in [train]: steps, " in str(err.value)


@pytest.mark.parametrize(
    "text, key, suggestion",
    [
        ("[train]\nstepz = 3\n", "train.stepz", "train.steps"),
        ("[trian]\nsteps = 3\n", "trian.steps", "train.steps"),
        ("steps = 3\n", "steps", "train.steps"),  # outside any table
        ("[data]\ntokeniser = 'byte'\n", "data.tokeniser", "data.tokenizer"),
    ],
)
def test_unknown_key_in_a_toml_file_names_the_file_and_suggests(tmp_path, text, key, suggestion):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value).startswith(f"unknown config key '{key}' in config file '{path}'; did you mean {suggestion}? ")


def test_unknown_optimizer_setting_suggests_the_nearest():
    from meshtron.train.optim.registry import check_optimizer

    for override, start in (
        (
            "optimizer.muon.momentun=0.9",
            "unknown config key 'optimizer.muon.momentun'; did you mean optimizer.muon.momentum? muon's own settings: ",
        ),
        (
            "optimizer.moun.momentum=0.9",
            "unknown config key 'optimizer.moun': no optimizer 'moun'; did you mean muon? ",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            check_optimizer(load_config(None, [override], env={}).optimizer)
        assert str(err.value).startswith(start), str(err.value)


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


def _old_keys_toml(cfg: Config) -> str:
    """``cfg`` as a config.toml written before the [optimizer] [schedule] [precision] [moe] sections: their keys
    under [train] with the old names."""
    data = to_dict(cfg)
    for old, new in DEPRECATED_KEYS.items():
        section, _, key = new.partition(".")
        if "." in key:  # optimizer.muon.momentum: the old file had every key, default or not
            name, _, setting = key.partition(".")
            value = data[section].get(name, {}).pop(setting, dataclasses.asdict(MuonSettings())[setting])
        else:
            value = data[section].pop(key)
        data["train"][old.partition(".")[2]] = value
    for section in ("schedule", "precision", "moe"):
        assert not data.pop(section)
    data["optimizer"] = {k: v for k, v in data["optimizer"].items() if isinstance(v, dict) and v}
    if not data["optimizer"]:
        del data["optimizer"]
    return tomli_w.dumps(data)


@pytest.fixture
def fresh_notes(monkeypatch):
    """Each test sees the deprecation notes as a new process does (each old key noted once)."""
    monkeypatch.setattr(config, "_deprecation_noted", set())


def test_an_old_key_in_a_toml_file_sets_the_new_one_with_a_note(tmp_path, fresh_notes):
    path = tmp_path / "old.toml"
    path.write_text('[train]\nsteps = 7\nlr = 0.01\nlr_schedule = "wsd"\nmuon_ns_steps = 7\nrouter_balance = "bias"\n')
    with pytest.warns(FutureWarning) as notes:
        cfg = load_config(path, env={})
    assert (cfg.train.steps, cfg.optimizer.lr, cfg.schedule.kind, cfg.moe.router_balance) == (7, 0.01, "wsd", "bias")
    assert cfg.optimizer.settings == {"muon": {"ns_steps": 7}}
    lines = [str(note.message) for note in notes]
    assert "train.lr is now optimizer.lr; the old key works until the next release, then is an error" in lines
    assert any("train.muon_ns_steps is now optimizer.muon.ns_steps" in line for line in lines)
    assert all("\n" not in line for line in lines) and len(lines) == 4


def test_an_old_key_on_the_command_line_is_noted_once_per_process(fresh_notes):
    with pytest.warns(FutureWarning, match="train.float8_recipe is now precision.float8_recipe"):
        cfg = load_config(None, ["--train.float8_recipe=rowwise", "train.muon_momentum=0.9"], env={})
    assert cfg.precision.float8_recipe == "rowwise" and cfg.optimizer.settings == {"muon": {"momentum": 0.9}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second load in the same process: no second note
        assert load_config(None, ["train.float8_recipe=rowwise"], env={}).precision == cfg.precision


def test_an_old_and_a_new_key_together_is_one_line_naming_both(tmp_path, fresh_notes):
    with pytest.raises(
        ConfigError, match=r"^train.lr and optimizer.lr are both set in the command line; .* keep optimizer.lr$"
    ):
        load_config(None, ["train.lr=0.1", "optimizer.lr=0.2"], env={})
    path = tmp_path / "both.toml"
    path.write_text("[train]\nmin_lr = 0.0\n[schedule]\nmin_lr = 0.0\n")
    with pytest.raises(ConfigError, match="train.min_lr and schedule.min_lr are both set in config file"):
        load_config(path, env={})
    # different sources: the usual precedence, the command line over the file (a saved old config, a new override)
    path.write_text("[train]\nlr = 0.5\n")
    with pytest.warns(FutureWarning):
        assert load_config(path, ["optimizer.lr=0.25"], env={}).optimizer.lr == 0.25


def test_a_saved_old_style_config_loads_as_the_same_settings(tmp_path, fresh_notes):
    """A run directory's or checkpoint's config.toml written before the sections: loaded as the resume
    (meshtron.train.run.segments), ``meshtron eval`` and export do, through load_config, it gives the same Config."""
    from meshtron.train.run.segments import _saved_config

    overrides = ["optimizer.name=muon", "optimizer.muon.momentum=0.9", "schedule.kind=wsd", "precision.float8=true"]
    new = load_config(None, [*overrides, "schedule.min_lr=1e-5", "moe.router_bias_rate=0.01"], env={})
    (tmp_path / "config.toml").write_text(_old_keys_toml(new))
    assert "[train]" in _old_keys_toml(new) and "[schedule]" not in _old_keys_toml(new)
    with pytest.warns(FutureWarning):
        saved = _saved_config(tmp_path)
    settings = {"muon": {"momentum": 0.9, "ns_steps": 5}}  # the old file named every key
    assert saved == dataclasses.replace(new, optimizer=dataclasses.replace(new.optimizer, settings=settings))


def test_validation_only_checks(fresh_notes):
    """validate_config never changes the config (resolve_config is the step that does), valid or not."""
    cfg = load_config(None, ["train.compile=1", "moe.router_aux_loss=off"], env={})
    assert (cfg.train.compile, cfg.moe.router_aux_loss) == ("true", "false")  # resolved by load_config
    unresolved = copy.deepcopy(cfg)
    unresolved.train.compile = "Yes"
    bad = copy.deepcopy(cfg)
    bad.schedule.min_lr = 1.0
    for case in (cfg, unresolved, bad):
        checked = copy.deepcopy(case)
        with contextlib.suppress(ConfigError):
            validate_config(checked)
        assert checked == case
    with pytest.raises(ConfigError, match="train.compile: 'Yes' is not one of"):
        validate_config(unresolved)
    resolve_config(unresolved)
    validate_config(unresolved)
    assert unresolved == cfg


def test_an_optimizers_own_settings(tmp_path):
    """``[optimizer.muon]`` / ``--optimizer.muon.KEY``: kept as given, checked against the registry entry's settings
    by the preflight (check_optimizer), written back as a table."""
    from meshtron.train.optim.registry import check_optimizer, optimizer_settings

    path = tmp_path / "muon.toml"
    path.write_text('[optimizer]\nname = "muon"\n[optimizer.muon]\nmomentum = 0.9\n')
    cfg = load_config(path, ["optimizer.muon.ns_steps=3"], env={})
    assert optimizer_settings(cfg.optimizer) == MuonSettings(momentum=0.9, ns_steps=3)
    save_config(cfg, tmp_path / "again.toml")
    assert "[optimizer.muon]" in (tmp_path / "again.toml").read_text()
    assert load_config(tmp_path / "again.toml", env={}) == cfg
    assert optimizer_settings(load_config(None, [], env={}).optimizer) == optimizer_settings(cfg.optimizer, "adamw")
    for overrides, message in (
        (["optimizer.name=sgd"], "optimizer.name: 'sgd' is not one of adamw, muon"),
        (
            ["optimizer.muon.nesterov=1"],
            "unknown config key 'optimizer.muon.nesterov'; muon's own settings: momentum, ",
        ),
        (["optimizer.muon.ns_steps=abc"], "optimizer.muon.ns_steps: expected int, got 'abc'"),
        (["optimizer.muon.ns_steps=0"], "optimizer.muon.ns_steps: must be a positive integer, got 0"),
        (["optimizer.muon.momentum=1"], "optimizer.muon.momentum: must be in [0, 1), got 1.0"),
        (["optimizer.adamw.betas=1"], "unknown config key 'optimizer.adamw.betas'; adamw's own settings: none"),
        (
            ["optimizer.sgd.momentum=1"],
            "unknown config key 'optimizer.sgd': no optimizer 'sgd'; the optimizers: adamw, ",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            check_optimizer(load_config(None, overrides, env={}).optimizer)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), overrides
    with pytest.raises(ConfigError, match="unknown config key 'optimizer.lr.x'"):
        load_config(None, ["optimizer.lr.x=1"], env={})
