"""Hub ids (``org/name``) for models and tokenizers (docs/models.md#hub-ids), without network: a Hugging Face cache
made here in the cache's own layout (``models--org--name/{refs, snapshots/<commit>, blobs}``), ``HF_HUB_OFFLINE=1``.
A run on a hub id trains from the cached snapshot and records its commit; a resume keeps that commit when main moves;
offline and not cached is one line; one process downloads while the others wait; an adapter export names its base so
that peft and ``meshtron generate`` find it from any folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tiny_llama_fixture
import torch
from conftest import run_cli, run_main, worker_env
from huggingface_hub import constants
from tiny_llama_fixture import save_character_tokenizer

from meshtron.checkpoint.integrity import META
from meshtron.config import load_config
from meshtron.data import hub
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
REPO_ID = "org/tiny"
FIRST, SECOND = "a" * 40, "b" * 40


def save_tiny_llama(folder: Path, seed: int) -> None:
    """A one-layer Llama with a character-level tokenizer, saved as the hub holds it."""
    tiny_llama_fixture.save_tiny_llama(folder, seed)
    save_character_tokenizer(folder)


def add_snapshot(cache: Path, repo_id: str, commit: str, source: Path, ref: str | None = "main") -> Path:
    """Put ``source``'s files into ``cache`` as the hub cache holds a download: blobs by hash, the snapshot's files
    linked to them, ``refs/<ref>`` naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache holding ``org/tiny`` at commit FIRST (main), and the texts to train on beside it."""
    root = tmp_path_factory.mktemp("hub")
    save_tiny_llama(root / "first", seed=0)
    add_snapshot(root / "cache", REPO_ID, FIRST, root / "first")
    (root / "text").mkdir()
    for i in range(6):
        (root / "text" / f"doc{i}.txt").write_text(f"document {i}: the cat sat on the mat, {i * 7} times over.\n")
    return root


@pytest.fixture
def offline_cache(hub_cache, monkeypatch) -> Path:
    """This process reads the test's cache, offline (huggingface_hub reads its settings at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.hub_snapshot.cache_clear()
    yield hub_cache / "cache"
    hub.hub_snapshot.cache_clear()


def run_settings(root: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"--model.name_or_path={REPO_ID}",
        f"--data.path={root / 'text'}",
        "--data.seq_len=16",
        f"--data.cache_dir={root / 'data-cache'}",
        "--train.global_batch_size=2",
        "--checkpoint.interval=1",
        "--run.progress=false",
        f"--run.output_dir={out}",
        *extra,
    ]


def test_a_hub_id_trains_from_the_cache_records_its_commit_and_a_resume_keeps_it(
    hub_cache, offline_cache, tmp_path, capsys
):
    out = tmp_path / "run"
    train(
        load_config(None, [item[2:] for item in run_settings(hub_cache, out, "--train.steps=1")], env={}), CPU_RUNTIME
    )
    # its own tokenizer, from the snapshot, named as the user named the model
    assert f"tokenizer: {REPO_ID}@{FIRST[:12]} (" in capsys.readouterr().out
    saved = load_config(out / "config.toml", env={})
    assert (saved.model.name_or_path, saved.model.revision) == (REPO_ID, FIRST)
    meta = json.loads((out / "checkpoints" / "step-00000001" / META).read_text())
    assert meta["model.revision"] == FIRST

    # main moves on to another commit (other weights): a resume by the launcher on 2 processes (which resolves the id
    # before the workers start and hands them the commit) keeps the checkpoint's commit, and says so once.
    save_tiny_llama(tmp_path / "second", seed=1)
    add_snapshot(offline_cache, REPO_ID, SECOND, tmp_path / "second")
    env = worker_env(HF_HUB_CACHE=str(offline_cache), HF_HUB_OFFLINE="1")
    try:
        proc = run_cli(["train", "--nproc", "2", *run_settings(hub_cache, out, "--train.steps=2")], env=env)
    finally:
        (offline_cache / "models--org--tiny" / "refs" / "main").write_text(FIRST)
        shutil.rmtree(offline_cache / "models--org--tiny" / "snapshots" / SECOND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notice = f"resuming on commit {FIRST[:12]}, which the checkpoint records; the hub's main is now {SECOND[:12]}"
    assert proc.stdout.count(notice) == 1 and "resumed from" in proc.stdout, proc.stdout
    assert f"tokenizer: {REPO_ID}@{FIRST[:12]} (" in proc.stdout, proc.stdout
    assert load_config(out / "config.toml", env={}).model.revision == FIRST


def test_an_adapter_of_a_hub_model_names_the_id_and_commit_and_generate_loads_it_elsewhere(
    hub_cache, offline_cache, tmp_path, monkeypatch
):
    from meshtron.checkpoint.export import export_checkpoint
    from meshtron.checkpoint.generate import generate_text

    out = tmp_path / "run"
    overrides = [item[2:] for item in run_settings(hub_cache, out, "--train.steps=1", "--lora.rank=2")]
    train(load_config(None, overrides, env={}), CPU_RUNTIME)
    adapter = export_checkpoint(
        str(out / "checkpoints" / "step-00000001"), str(tmp_path / "adapter"), adapter_only=True
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == (REPO_ID, FIRST)
    monkeypatch.chdir(tmp_path / "run")
    assert generate_text(str(adapter), "ab", max_new_tokens=2)


def test_the_resume_notice_names_both_commits():
    from meshtron.train.setup.preflight import revision_notice

    line = revision_notice(REPO_ID, FIRST, SECOND)
    assert FIRST[:12] in line and SECOND[:12] in line and "model.revision=main" in line
    assert revision_notice(REPO_ID, FIRST, FIRST) is None and revision_notice(REPO_ID, FIRST, None) is None


def test_offline_and_not_cached_is_one_line_naming_the_id_and_the_cache(hub_cache, offline_cache, tmp_path):
    settings = run_settings(hub_cache, tmp_path / "run", "--train.steps=1")[1:]
    proc = run_main(["train", *settings, "--model.name_or_path=org/absent"])
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "org/absent" in lines[0] and str(offline_cache) in lines[0] and "HF_HUB_OFFLINE" in lines[0], lines[0]
    with pytest.raises(ConfigError, match="data.tokenizer: 'org/absent'"):
        from meshtron.data.tokenizer import load_tokenizer

        load_tokenizer("org/absent")


def test_a_revision_needs_a_hub_id(tmp_path):
    from meshtron.config import ModelConfig
    from meshtron.models.build import check_model_path

    with pytest.raises(ConfigError, match="model.revision: .* is a local folder"):
        check_model_path(ModelConfig(name_or_path=str(tmp_path), revision="main"))
    assert not hub.is_hub_id(str(tmp_path)) and hub.is_hub_id("Qwen/Qwen3-0.6B") and not hub.is_hub_id("a/b/c")


def test_one_process_downloads_while_the_others_wait_and_then_find_it_cached(hub_cache, tmp_path, monkeypatch):
    """A second process holds the download lock and fills the cache meanwhile: this one waits for it, then takes
    the snapshot from the cache without downloading."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.hub_snapshot.cache_clear()
    monkeypatch.setattr(hub, "_download", lambda *args: pytest.fail("downloaded although another process had"))
    held, released = tmp_path / "held", tmp_path / "released"
    holder = textwrap.dedent(
        f"""
        import sys, time
        from huggingface_hub import constants
        constants.HF_HUB_CACHE = {str(cache)!r}
        import shutil
        from meshtron.data import hub
        from pathlib import Path
        with hub.download_lock({REPO_ID!r}):
            Path({str(held)!r}).touch()
            time.sleep(1.0)
            shutil.copytree({str(hub_cache / "first")!r}, {str(cache / "models--org--tiny" / "snapshots" / FIRST)!r})
            Path({str(released)!r}).touch()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", holder], env=worker_env())
    try:
        while not held.exists():
            assert child.poll() is None, "the lock holder ended early"
        folder = hub.hub_snapshot(REPO_ID, FIRST, False, "model.name_or_path")
        assert released.exists()  # it waited for the holder
        assert folder == cache / "models--org--tiny" / "snapshots" / FIRST
    finally:
        assert child.wait(timeout=60) == 0
        hub.hub_snapshot.cache_clear()


def test_a_snapshot_with_a_config_and_no_weights_is_fetched_again(hub_cache, tmp_path):
    partial = tmp_path / "partial"  # what AutoConfig / AutoTokenizer leave of a model repository
    partial.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copyfile(hub_cache / "first" / name, partial / name)
    assert not hub.is_whole(partial) and hub.is_whole(hub_cache / "first")
    (partial / "config.json").unlink()  # a tokenizer's repository
    assert hub.is_whole(partial)


def test_what_is_fetched_prefers_safetensors_and_fetches_code_only_when_asked(monkeypatch):
    from huggingface_hub import HfApi

    files = {"with": ["config.json", "model.safetensors", "pytorch_model.bin"], "without": ["pytorch_model.bin"]}
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, repo_id, revision=None: files[repo_id.split("/")[1]])
    patterns = hub._patterns("org/with", "main", remote_code=False)
    assert "*.safetensors" in patterns and "*.bin" not in patterns and "*.py" not in patterns
    patterns = hub._patterns("org/without", "main", remote_code=True)
    assert "*.bin" in patterns and "*.safetensors" not in patterns and "*.py" in patterns
