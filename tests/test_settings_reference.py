"""The settings reference (docs/configuration.md) is the config dataclasses', docs/models.md lists every preset,
``meshtron train --print-config`` round-trips, ``meshtron train --help`` names every setting. All in-process."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import re

import pytest
from conftest import REPO, run_main

from meshtron.config import CHOICES, ENV_DEGREES, Config, load_config
from meshtron.errors import ConfigError
from meshtron.models.presets import ALIASES, PRESETS, make_preset_config, preset_names
from meshtron.settings_reference import BEGIN, END, PAGE, REGENERATE, render_page, row, sections
from meshtron.train.optim.registry import OPTIMIZERS

DOCS = REPO / "docs"
SETTINGS = [setting for _, settings in sections().values() for setting in settings]
BY_KEY = {setting.key: setting for setting in SETTINGS}
NOT_A_CHOICE = "no-such-choice"


def test_page_equals_the_generator():
    assert PAGE == DOCS / "configuration.md"
    page = PAGE.read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    expected = render_page(page)
    diff = "\n".join(difflib.unified_diff(page.splitlines(), expected.splitlines(), "page", "generated", lineterm=""))
    assert page == expected, (
        f"docs/configuration.md differs from the settings of meshtron/config.py; regenerate it with "
        f"`{REGENERATE}`:\n{diff[:3000]}"
    )


def test_every_setting_and_section_has_a_docstring():
    assert [f.name for f in dataclasses.fields(Config)] == list(sections())
    fields = sum(len(dataclasses.fields(f.default_factory)) for f in dataclasses.fields(Config))
    own = [f"optimizer.{n}.{f.name}" for n, e in OPTIMIZERS.items() for f in dataclasses.fields(e.settings)]
    assert own and set(own) <= set(BY_KEY) and "optimizer.settings" not in BY_KEY  # a row per optimizer's setting
    assert len(SETTINGS) == fields - 1 + len(own)
    for name, (doc, settings) in sections().items():
        assert doc, f"the [{name}] dataclass needs a docstring"
        for setting in settings:
            assert setting.doc, f"{setting.key} needs an attribute docstring (the string under the field)"


def _companions(key: str, value: str) -> list[str]:
    """The settings without which ``key=value`` cannot stand: a preference objective and its data come together,
    a LoRA-base reference needs LoRA, distillation its teacher."""
    if key == "train.objective" and value == "distill":
        return ["distill.teacher=llama-small"]
    if key == "train.objective" and value != "causal_lm":
        return ["data.format=preference"]
    if key.startswith("distill."):
        return ["train.objective=distill", "distill.teacher=llama-small"]
    if key == "data.format" and value == "preference":
        return ["train.objective=dpo"]
    if key.startswith(("preference.", "dpo.")):
        return ["train.objective=dpo", "data.format=preference"] + (
            ["lora.rank=4"] if key.endswith("reference") else []
        )
    return []


def _accepts(key: str, value: str) -> bool:
    """Whether validation takes ``--key=value`` (on a config where every choice can stand: rollback needs
    checkpoints, a preference objective its data)."""
    try:
        load_config(None, [f"{key}={value}", "checkpoint.interval=1", *_companions(key, value)], env={})
    except ConfigError as err:
        assert key in str(err), err
        return False
    return True


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_choices_shown_are_what_validation_accepts(key):
    setting = BY_KEY[key]
    shown = row(setting)
    assert setting.choices and set(CHOICES[key]) <= set(setting.choices)
    for choice in setting.choices:
        assert f"`{choice}`" in shown
        assert _accepts(key, choice), f"{key}={choice} is listed but refused"
    assert not _accepts(key, NOT_A_CHOICE)


def test_only_the_listed_settings_take_choices():
    """A string setting outside CHOICES takes no fixed set of values: no validation refuses it as 'not one of'."""
    for setting in SETTINGS:
        if setting.key in CHOICES or not isinstance(setting.default, (str, type(None), list)):
            continue
        try:
            load_config(None, [f"{setting.key}={NOT_A_CHOICE}"], env={})
        except ConfigError as err:
            assert "is not one of" not in str(err), f"{setting.key} has choices: add them to config.CHOICES"


def test_aliases_and_environment_shown():
    assert BY_KEY["checkpoint.async_save"].aliases == ("checkpoint.async",)
    assert "`checkpoint.async`" in row(BY_KEY["checkpoint.async_save"])
    assert load_config(None, ["checkpoint.async=true"], env={}).checkpoint.async_save
    for var, key in ENV_DEGREES.items():
        assert f"`{var}`" in row(BY_KEY[f"parallel.{key}"])


def test_every_preset_is_listed():
    shown = row(BY_KEY["model.preset"])
    assert set(re.findall(r"`([\w.-]+)`", shown.split("Choices:")[1])) == set(preset_names())
    with pytest.raises(ConfigError, match="unknown preset"):
        make_preset_config(NOT_A_CHOICE, 256)


def test_models_page_lists_every_preset_as_defined():
    """docs/models.md's preset table: every preset and alias, with its family and shape from presets.py."""
    # name (alias), family, hidden, layers, heads / kv heads
    cells = r"^\| `([\w.-]+)`(?: \(`(\w+)`\))? \| (\w+) \| (\d+) \| (\d+) \| (\d+) / (\d+) \|"
    rows = re.findall(cells, (DOCS / "models.md").read_text(), re.M)
    assert sorted(name for name, *_ in rows) == sorted(PRESETS)
    assert {alias: name for name, alias, *_ in rows if alias} == ALIASES
    for name, _, family, hidden, layers, heads, kv_heads in rows:
        preset = PRESETS[name]
        shape = (preset["hidden_size"], preset["num_hidden_layers"], preset["num_attention_heads"])
        assert (family, int(hidden), int(layers), int(heads)) == (preset["model_type"], *shape), name
        assert int(kv_heads) == (preset.get("num_key_value_heads") or preset["num_attention_heads"]), name


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_in_the_reference_resolve():
    page = PAGE.read_text()
    links = re.findall(r"\]\(([\w.-]+\.md)(?:#([\w-]+))?\)", page[page.index(BEGIN) : page.index(END)])
    assert len(links) > 20
    for name, anchor in links:
        target = DOCS / name
        assert target.is_file(), name
        if anchor:
            slugs = {_slug(line.lstrip("#")) for line in target.read_text().splitlines() if line.startswith("#")}
            assert anchor in slugs, f"{name}#{anchor}"


def test_cache_dir_default_follows_xdg(tmp_path, monkeypatch):
    """data.cache_dir unset: $XDG_CACHE_HOME/meshtron when set, else ~/.cache/meshtron (as its docstring says)."""
    from meshtron.data.dataset import default_cache_dir

    assert "$XDG_CACHE_HOME/meshtron" in BY_KEY["data.cache_dir"].doc and BY_KEY["data.cache_dir"].default is None
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "meshtron"
    for unset in (lambda: monkeypatch.delenv("XDG_CACHE_HOME"), lambda: monkeypatch.setenv("XDG_CACHE_HOME", "")):
        unset()
        assert default_cache_dir() == tmp_path / "home" / ".cache" / "meshtron"


def test_print_config_round_trips(tmp_path, monkeypatch):
    """--print-config: defaults + TOML + environment + overrides, validated, as TOML that loads back to the same
    config; nothing trains."""
    for var in ENV_DEGREES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TP_SIZE", "2")
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nsteps = 7\ncompile = true\n[model]\npreset = "qwen3-tiny"\n')
    overrides = [
        "--optimizer.lr=0.001",
        "--fsdp.reduce_dtype=none",
        "--checkpoint.async=true",
        "--run.loggers=jsonl,tensorboard",
        "--data.skip_batches=3,4",
        f"--run.output_dir={tmp_path / 'run'}",
    ]
    result = run_main(["train", "--print-config", "--config", str(toml), *overrides])
    assert result.returncode == 0 and not result.stderr, result.stderr
    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    again = load_config(printed, env={})
    assert again == load_config(toml, [item[2:] for item in overrides], env={"TP_SIZE": "2"})
    assert (again.train.steps, again.train.compile, again.model.preset) == (7, "true", "qwen3-tiny")
    assert (again.parallel.tp, again.optimizer.lr, again.fsdp.reduce_dtype, again.checkpoint.async_save) == (
        2,
        0.001,
        None,
        True,
    )
    assert again.run.loggers == ["jsonl", "tensorboard"] and again.data.skip_batches == [3, 4]
    assert not (tmp_path / "run").exists()
    bad = run_main(["train", "--print-config", "--train.steps=0"])
    assert bad.returncode == 2 and "train.steps" in bad.stderr and not bad.stdout


def test_train_help_names_every_setting():
    from meshtron.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    text = out.getvalue()
    assert stop.value.code == 0
    assert "docs/configuration.md" in text and "--print-config" in text
    for name, (_, settings) in sections().items():
        listed = re.search(rf"\[{name}\] (.*?)(?=\n  \[|\Z)", text, re.S)
        assert listed and listed[1].split() == [setting.key.partition(".")[2] for setting in settings], name
