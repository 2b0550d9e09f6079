"""``data.tokenizer=auto`` (the default): a fine-tune of a model folder trains on that folder's tokenizer when it has
one, else on the byte tokenizer and says so in one line; an explicit ``byte`` with a pretrained model warns; the
start-up line names the tokenizer; every command that reads ``data.tokenizer`` resolves ``auto`` the same way."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import run_main
from tiny_llama_fixture import CHARACTERS, save_character_tokenizer, save_tiny_llama

from meshtron.config import load_config
from meshtron.data.dataset import cache_path
from meshtron.data.shards import TokenCorpus
from meshtron.data.sources import iter_documents
from meshtron.data.tokenizer import (
    BYTE_MODEL_VOCAB,
    ByteTokenizer,
    HFTokenizer,
    has_tokenizer,
    load_tokenizer,
    resolve_tokenizer,
)
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError
from meshtron.models.presets import make_preset_config
from meshtron.train.setup.preflight import preflight
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``own``: a tiny Llama (vocabulary 320, more than both tokenizers') with its character-level tokenizer saved
    beside it; ``bare``: the same model without a tokenizer; ``text``: a few documents."""
    root = tmp_path_factory.mktemp("auto-tokenizer")
    save_tiny_llama(root / "bare", seed=0, vocab_size=320)
    shutil.copytree(root / "bare", root / "own")
    save_character_tokenizer(root / "own")
    (root / "text").mkdir()
    for i in range(6):
        (root / "text" / f"doc{i}.txt").write_text(f"document {i}: the cat sat on the mat, {i * 7} times over.\n")
    return root


def run_config(model_dir, tmp_path, *extra: str):
    return load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            f"data.path={model_dir.parent / 'text'}",
            "data.seq_len=16",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=1",
            "train.global_batch_size=2",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'run'}",
            *extra,
        ],
        env={},
    )


def trained_tokens(cfg, tokenizer) -> np.ndarray:
    """The token stream the run trained on: its prepared cache of data.path under ``tokenizer``."""
    corpus = TokenCorpus(cache_path(cfg.data, tokenizer))
    return corpus.read(0, corpus.num_tokens)


def encoded(cfg, tokenizer) -> np.ndarray:
    """data.path's documents encoded by ``tokenizer``, each followed by its EOS."""
    return np.concatenate(
        [np.append(tokenizer.encode(doc), tokenizer.eos_token_id) for doc in iter_documents(cfg.data.path)]
    )


def test_auto_trains_a_model_folder_on_its_own_tokenizer(folders, tmp_path, capsys):
    cfg = run_config(folders / "own", tmp_path, "checkpoint.interval=1")
    assert cfg.data.tokenizer == "auto"  # the default
    train(cfg, CPU_RUNTIME)
    out = capsys.readouterr().out
    own = HFTokenizer(str(folders / "own"))
    assert f" | tokenizer: {own.name} (97) | " in out, out
    assert "data.tokenizer" not in out, out  # nothing to warn about
    tokens = trained_tokens(cfg, own)
    assert np.array_equal(tokens, encoded(cfg, own)) and tokens.max() < len(CHARACTERS)
    assert load_config(tmp_path / "run" / "config.toml", env={}).data.tokenizer == "auto"  # as the user set it

    # The checkpoint's config says auto: eval, export and generate resolve it to the model folder's tokenizer too.
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"
    proc = run_main(["eval", str(checkpoint), f"--eval.path={cfg.data.path}", f"--run.output_dir={tmp_path / 'ev'}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f" | tokenizer: {own.name} (97) | " in proc.stdout, proc.stdout
    proc = run_main(["export", str(checkpoint), str(tmp_path / "hf")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert has_tokenizer(tmp_path / "hf") and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_auto_without_a_tokenizer_trains_on_bytes_and_says_so_once(folders, tmp_path, capsys):
    cfg = run_config(folders / "bare", tmp_path)
    train(cfg, CPU_RUNTIME)
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "data.tokenizer" in line]
    assert said == [
        f"meshtron: data.tokenizer=auto: {folders / 'bare'} has no tokenizer; using the byte tokenizer's 257 ids; "
        "set data.tokenizer=DIR to use another"
    ], out
    assert " | tokenizer: byte (257) | " in out, out
    assert np.array_equal(trained_tokens(cfg, ByteTokenizer()), encoded(cfg, ByteTokenizer()))


def test_explicit_byte_with_a_pretrained_model_warns_and_trains_on_bytes(folders, tmp_path):
    """``byte`` set (as every config saved before ``auto`` says it) stays bytes, with a warning line for rank 0."""
    (tmp_path / "old.toml").write_text(f'[model]\nname_or_path = "{folders / "own"}"\n[data]\ntokenizer = "byte"\n')
    setup = preflight(load_config(tmp_path / "old.toml", env={}), 1, "cpu")
    assert isinstance(setup.tokenizer, ByteTokenizer)
    assert setup.tokenizer_notice == (
        f"meshtron: warning: data.tokenizer=byte with model.name_or_path={folders / 'own'}: using the byte "
        "tokenizer's 257 ids; leave data.tokenizer out (auto) to use the model's own"
    )
    bare = preflight(run_config(folders / "bare", tmp_path, "data.tokenizer=byte"), 1, "cpu")
    assert "set data.tokenizer=DIR to the model's tokenizer folder" in bare.tokenizer_notice
    scratch = preflight(load_config(None, ["model.preset=tiny"], env={}), 1, "cpu")  # no pretrained model
    assert isinstance(scratch.tokenizer, ByteTokenizer) and scratch.tokenizer_notice is None


def test_auto_refuses_bytes_for_a_model_made_for_another_tokenizer(folders, tmp_path):
    """A pretrained model of more ids than a byte model's (a preset pads 257 to 320) and no tokenizer in its folder:
    ``auto`` refuses in one line naming data.tokenizer and both fixes, before any process group (``train`` and
    ``data prepare`` alike); ``data.tokenizer=byte`` trains it on bytes on purpose, with its warning."""
    assert BYTE_MODEL_VOCAB == make_preset_config("tiny", ByteTokenizer.vocab_size).vocab_size == 320
    big = tmp_path / "big"
    shutil.copytree(folders / "bare", big)
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    refusal = (
        f"meshtron: error: data.tokenizer=auto: {big} has no tokenizer and its model has 1,000 ids, not the byte "
        "tokenizer's 257; point data.tokenizer at the model's tokenizer folder or hub id, or set data.tokenizer=byte "
        "to train it on bytes on purpose"
    )
    text = f"--data.path={folders / 'text'}"
    for command in (["train", "--nproc", "2", "--data.seq_len=16"], ["data", "prepare", "--out", str(tmp_path / "p")]):
        proc = run_main([*command, f"--model.name_or_path={big}", text])
        assert proc.returncode != 0 and proc.stderr.strip() == refusal, proc.stderr
    on_purpose = preflight(run_config(big, tmp_path, text[2:], "data.tokenizer=byte"), 1, "cpu")
    assert isinstance(on_purpose.tokenizer, ByteTokenizer) and on_purpose.hf_config.vocab_size == 1000
    assert isinstance(load_tokenizer("auto", model_dir=big), ByteTokenizer)  # an older checkpoint's export reads it
    assert on_purpose.tokenizer_notice.startswith(
        f"meshtron: warning: data.tokenizer=byte with model.name_or_path={big}"
    )


def test_what_counts_as_a_tokenizer_folder(tmp_path):
    assert not has_tokenizer(tmp_path) and not has_tokenizer(None)
    assert resolve_tokenizer("auto", tmp_path) == "byte" and resolve_tokenizer("auto", None) == "byte"
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        (folder / name).write_text("{}")
        assert has_tokenizer(folder) and resolve_tokenizer("auto", folder) == str(folder)
        assert resolve_tokenizer("byte", folder) == "byte" and resolve_tokenizer("/tok", folder) == "/tok"


def test_data_prepare_resolves_auto_like_training(folders, tmp_path, capsys):
    """``meshtron data prepare`` with model.name_or_path tokenizes with the model's tokenizer; training that model
    on the prepared corpus passes the fingerprint check, while the same corpus refuses a run on bytes."""
    own = HFTokenizer(str(folders / "own"))
    data = f"--data.path={folders / 'text'}"
    proc = run_main(["data", "prepare", data, f"--model.name_or_path={folders / 'own'}", "--out", str(tmp_path / "p")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--data.tokenizer={own.name}" in proc.stdout
    assert TokenCorpus(tmp_path / "p").manifest["tokenizer"]["name"] == own.name
    preflight(run_config(folders / "own", tmp_path, f"data.path={tmp_path / 'p'}"), 1, "cpu")
    with pytest.raises(ConfigError, match=f"was prepared with the tokenizer '{own.name}'"):
        preflight(run_config(folders / "bare", tmp_path, f"data.path={tmp_path / 'p'}"), 1, "cpu")

    proc = run_main(["data", "prepare", data, f"--model.name_or_path={folders / 'bare'}", "--out", str(tmp_path / "q")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"data.tokenizer=auto: {folders / 'bare'} has no tokenizer" in proc.stdout
    assert TokenCorpus(tmp_path / "q").manifest["tokenizer"]["name"] == "byte"


def test_chat_data_and_generate_take_the_model_folders_tokenizer(folders, tmp_path, monkeypatch):
    from chat_fixture import CHAT_DATA, CHAT_MODEL, write_chat_fixture

    import meshtron.checkpoint.generate as generate

    write_chat_fixture(tmp_path)
    chat = preflight(
        load_config(
            None,
            [f"model.name_or_path={tmp_path / CHAT_MODEL}", f"data.path={tmp_path / CHAT_DATA}", "data.format=chat"],
            env={},
        ),
        1,
        "cpu",
    )
    assert chat.tokenizer.name == str((tmp_path / CHAT_MODEL).resolve())

    monkeypatch.setattr(generate, "_generate", lambda model_dir, tok, *rest: tok.name)
    assert generate.generate_text(str(folders / "own"), "hi") == str((folders / "own").resolve())
    assert generate.generate_text(str(folders / "bare"), "hi") == "byte"
    assert generate.generate_text(str(folders / "own"), "hi", tokenizer="byte") == "byte"
