"""Hugging Face hub ids (``org/name``) for models and tokenizers, resolved to a snapshot folder in the standard Hugging
Face cache (``HF_HUB_CACHE``, or ``$HF_HOME/hub``).

One process per machine downloads while the others wait on a file lock in the cache (no collective: the launcher
resolves before the workers start, and a worker finds the snapshot there). Only what training reads is fetched:
config, tokenizer files and safetensors weights (``.bin`` only where the repository has no safetensors; ``.py`` only
with ``model.trust_remote_code``). ``HF_HUB_OFFLINE=1`` is honoured: a snapshot not in the cache is one error naming
the id and the cache folder. This module sits in ``data/`` because tokenizers are loaded here, below ``models/``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from meshtron.errors import ConfigError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
CONFIG_AND_TOKENIZER = [
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
]
SAFETENSORS = ["*.safetensors"]
PICKLED = ["*.bin"]
REMOTE_CODE = ["*.py"]


def is_hub_id(value: str | None) -> bool:
    """Whether ``value`` names a hub repository (``org/name``) rather than a local folder: no such path exists here
    and it has the hub's two-part shape."""
    if not value or Path(value).expanduser().exists():
        return False
    return bool(HUB_ID.match(value)) and not value.startswith((".", "~"))


def cache_folder() -> Path:
    """The Hugging Face hub cache this process uses (HF_HUB_CACHE, or $HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download_lock(repo_id: str):
    """The machine-wide lock, in the cache, that one downloading process holds while the others wait."""
    from filelock import FileLock

    locks = cache_folder() / ".locks" / "meshtron"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{repo_id.replace('/', '--')}.lock"))


def cached_snapshot(repo_id: str, revision: str) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None


def is_whole(snapshot: Path) -> bool:
    """Whether a cached snapshot holds a model (config.json and weights) or a tokenizer, not only what another tool
    fetched of it (a config read by ``AutoConfig``, say)."""
    if any(snapshot.glob("*.safetensors")) or any(snapshot.glob("*.bin")):
        return (snapshot / "config.json").is_file()
    return not (snapshot / "config.json").is_file() and (snapshot / "tokenizer_config.json").is_file()


def _patterns(repo_id: str, revision: str, remote_code: bool) -> list[str]:
    """What to fetch: safetensors where the repository has them, else its .bin weights."""
    from huggingface_hub import HfApi

    files = HfApi().list_repo_files(repo_id, revision=revision)
    weights = SAFETENSORS if any(name.endswith(".safetensors") for name in files) else PICKLED
    return CONFIG_AND_TOKENIZER + weights + (REMOTE_CODE if remote_code else [])


def _download(repo_id: str, revision: str, remote_code: bool) -> Path:
    from huggingface_hub import snapshot_download

    patterns = _patterns(repo_id, revision, remote_code)
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))


def not_cached_error(setting: str, repo_id: str, revision: str) -> ConfigError:
    return ConfigError(
        f"{setting}: '{repo_id}' (revision {revision}) is neither a local folder nor in the Hugging Face cache "
        f"{cache_folder()}, and HF_HUB_OFFLINE is set; download it once online, or give a local folder"
    )


@functools.lru_cache(maxsize=None)
def hub_snapshot(repo_id: str, revision: str | None, remote_code: bool, setting: str) -> Path:
    """The local snapshot folder of hub id ``repo_id`` at ``revision`` (unset: main), downloaded if need be; a
    commit, or anything offline, is taken from the cache without asking the hub. Its name is the commit."""
    revision = revision or "main"
    cached = cached_snapshot(repo_id, revision)
    if cached is not None and ((COMMIT.match(revision) and is_whole(cached)) or _offline()):
        return cached
    if _offline():
        raise not_cached_error(setting, repo_id, revision)
    with download_lock(repo_id):
        if COMMIT.match(revision):  # another process may have fetched it while this one waited
            cached = cached_snapshot(repo_id, revision)
            if cached is not None and is_whole(cached):
                return cached
        try:
            return _download(repo_id, revision, remote_code)
        except Exception as err:  # noqa: BLE001 - any hub failure (no such repo, no network) is one line
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"{setting}: '{repo_id}' (revision {revision}) is not a local folder and could not be fetched from "
                f"the Hugging Face hub ({first_line}); check the id, or give a local folder"
            ) from None


def local_folder(
    name_or_path: str | None, revision: str | None = None, remote_code: bool = False, setting: str = ""
) -> str | None:
    """``name_or_path`` as a local folder: a hub id's cached snapshot (see ``hub_snapshot``), else itself."""
    if not is_hub_id(name_or_path):
        return name_or_path
    return str(hub_snapshot(name_or_path, revision, remote_code, setting or "model.name_or_path"))


def model_folder(model) -> str | None:
    """``model.name_or_path`` (a ``ModelConfig``) as a local folder, at ``model.revision`` for a hub id."""
    return local_folder(model.name_or_path, model.revision, model.trust_remote_code, "model.name_or_path")


SNAPSHOT_FOLDER = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{7,64})/?$")


def shown_name(folder: str | Path) -> str:
    """``folder`` as a user named it: ``org/name@commit`` (12 characters of it) for a hub cache's snapshot folder,
    else the folder itself."""
    match = SNAPSHOT_FOLDER.search(str(folder))
    return f"{match['org']}/{match['name']}@{match['commit'][:12]}" if match else str(folder)


def snapshot_commit(folder: str | Path) -> str:
    """The commit of a hub snapshot folder (the cache names it so)."""
    return Path(folder).name


def main_commit(repo_id: str) -> str | None:
    """Where the hub's ``main`` of ``repo_id`` is now (the cache's record when offline), or None if unknown."""
    if not _offline():
        try:
            from huggingface_hub import HfApi

            return HfApi().model_info(repo_id, revision="main").sha
        except Exception:  # noqa: BLE001 - only for a notice: no network, no answer
            return None
    ref = cache_folder() / f"models--{repo_id.replace('/', '--')}" / "refs" / "main"
    return ref.read_text().strip() if ref.is_file() else None
