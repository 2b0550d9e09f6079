"""Where documents come from: text files, folders, JSON lines, Parquet, ``datasets`` dirs or hub names.

Every reader yields documents (non-empty strings) in a deterministic order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Iterator

from meshtron.config import BUILTIN_CORPUS
from meshtron.data.shards import is_prepared
from meshtron.errors import ConfigError, import_extra

DATA_EXTRA = "data"
"""The meshtron extra (pyproject.toml) that installs ``datasets`` and ``pyarrow``: Parquet files, saved datasets, hub
datasets and ``data.streaming`` need it; text files, JSON lines and prepared corpora do not."""
TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst", ".text")
FOLDER_EXTENSIONS = TEXT_EXTENSIONS + (".jsonl", ".parquet")
JSON_EXTENSIONS = (".jsonl", ".json")
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_BATCH = 1024


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS)


def _looks_like_file_path(spec: str) -> bool:
    if spec.startswith(("/", "./", "../", "~", ".\\")) or "\\" in spec or spec.count("/") > 1:
        return True
    return bool(_EXTENSION.fullmatch(os.path.splitext(spec)[1])) or not _HUB_NAME.fullmatch(spec)


def _folder_files(root: Path) -> list[Path]:
    """Files under ``root`` a folder source reads, sorted by relative path (hidden names skipped)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.lower().endswith(FOLDER_EXTENSIONS):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests, IDLE, lib2to3 and site-packages skipped), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def check_data_path(path: str, setting: str = "data.path") -> None:
    """Raise ConfigError (naming ``setting``, ``data.path`` or ``eval.path``, and the fix) if ``path`` cannot give
    any documents."""
    if path == BUILTIN_CORPUS:
        return
    fix = f"set {setting} to an existing text file, folder, .jsonl, .parquet or saved dataset, or {BUILTIN_CORPUS}"
    if not path:
        raise ConfigError(f"{setting} is empty; {fix}")
    local = Path(path).expanduser()
    if local.is_file():
        if local.stat().st_size == 0:
            raise ConfigError(f"{setting}: '{path}' is an empty file; {fix}")
    elif local.is_dir():
        if is_prepared(local):
            return
        if not _is_saved_dataset(local) and not any(f.stat().st_size > 0 for f in _folder_files(local)):
            raise ConfigError(f"{setting}: folder '{path}' has no non-empty {'/'.join(FOLDER_EXTENSIONS)} files; {fix}")
    elif local.exists():
        raise ConfigError(f"{setting}: '{path}' is neither a file nor a folder; {fix}")
    elif _looks_like_file_path(path):
        raise ConfigError(f"{setting}: '{path}' does not exist (nor is it a hub dataset name like org/name); {fix}")


CHAT_FIELDS = ("messages", "conversations")
"""Fields that hold a conversation in the usual chat formats: text records with one are chat data."""


def _chat_hint(field: str) -> str:
    """The fix for text settings on chat data whose conversations are in ``field``."""
    fix = "set data.format=chat" + ("" if field == "messages" else f" and data.messages_field={field}")
    return f"it looks like chat data ({field}): {fix}"


def _chat_field(available: Iterable[str] | dict) -> str | None:
    """The chat field of a record (a dict: only where it holds a list) or of a table's columns, else None."""
    for name in CHAT_FIELDS:
        if name in available and (not isinstance(available, dict) or isinstance(available[name], list)):
            return name
    return None


def _field_error(field: str, where: str, available: Iterable[str] | dict) -> ConfigError:
    chat = _chat_field(available)
    if chat is not None:
        return ConfigError(f"data.text_field: '{field}' is not in {where}; {_chat_hint(chat)}")
    names = ", ".join(sorted(str(a) for a in available)) or "none"
    return ConfigError(f"data.text_field: '{field}' is not in {where}; available fields: {names}; set data.text_field")


def _text_value(value: Any, field: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        kind = type(value).__name__
        fix = _chat_hint(field) if field in CHAT_FIELDS and isinstance(value, list) else "pick a text field"
        raise ConfigError(f"data.text_field: '{field}' in {where} is {kind}, not text; {fix}")
    return value


TEXT_SOURCES = "UTF-8 text files, .jsonl, .parquet or a saved dataset"


def not_text_error(path: Path, reads: str = TEXT_SOURCES) -> ConfigError:
    """The error for a file of ``data.path`` that is not text (a binary file); ``reads``: what it should be."""
    return ConfigError(f"data.path: {path} is not UTF-8 text (a binary file?); point data.path at {reads}")


def utf8_only(path: Path, items: Iterator, reads: str = TEXT_SOURCES) -> Iterator:
    """``items``, read from ``path``, with a UnicodeDecodeError turned into ``not_text_error``."""
    try:
        yield from items
    except UnicodeDecodeError:
        raise not_text_error(path, reads) from None


def _read_text(path: Path) -> Iterator[str]:
    """The whole file, one document; a few bytes that are not UTF-8 are replaced, but a binary file (a NUL byte in
    its first 8 KiB, or more than one character in 10 not UTF-8) is an error."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if b"\x00" in raw[:8192] or text.count("\ufffd") * 10 > len(text):
        raise not_text_error(path)
    yield text


def _json_objects(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, object) pairs: one object per line, or the items of a top-level JSON array (.json)."""
    return utf8_only(path, _json_items(path))


def _json_items(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        if path.suffix.lower() == ".json" and fh.read(4096).lstrip().startswith("["):
            fh.seek(0)
            try:
                items = json.load(fh)
            except json.JSONDecodeError as err:
                raise ConfigError(f"data.path: {path} is not valid JSON ({err}); fix the file") from None
            for i, obj in enumerate(items):
                yield f"{path}[{i}]", obj
            return
        fh.seek(0)
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"data.path: {path}:{lineno} is not valid JSON ({err}); write one JSON object per line"
                ) from None
            yield f"{path}:{lineno}", obj


def _read_json_lines(path: Path, field: str) -> Iterator[str]:
    for where, obj in _json_objects(path):
        if not isinstance(obj, dict):
            raise ConfigError(f"data.path: {where} is not a JSON object; write one object per line")
        if field not in obj:
            raise _field_error(field, where, obj)
        yield _text_value(obj[field], field, where)


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    pq = import_extra("pyarrow.parquet", needed_by=f"data.path: reading Parquet ({path})", extra=DATA_EXTRA)

    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"data.path: {path} is not a readable Parquet file ({err}); fix or remove it") from None
    if field not in pf.schema_arrow.names:
        raise _field_error(field, str(path), pf.schema_arrow.names)
    for batch in pf.iter_batches(batch_size=_BATCH, columns=[field]):
        for value in batch.column(0).to_pylist():
            yield _text_value(value, field, str(path))


def _read_file(path: Path, field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in JSON_EXTENSIONS:
        return _read_json_lines(path, field)
    if suffix == ".parquet":
        return _read_parquet(path, field)
    return _read_text(path)


def _read_dataset(ds: Any, field: str, where: str) -> Iterator[str]:
    if field not in ds.column_names:
        raise _field_error(field, where, ds.column_names)
    for batch in ds.select_columns([field]).iter(batch_size=_BATCH):
        for value in batch[field]:
            yield _text_value(value, field, where)


def _load_saved(path: Path) -> Any:
    datasets = import_extra("datasets", needed_by=f"data.path: a saved dataset ({path})", extra=DATA_EXTRA)

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"data.path: '{path}' looks like a saved dataset but does not load ({err}); save it again with "
            "save_to_disk or point data.path at its files"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            splits = ", ".join(ds)
            raise ConfigError(f"data.path: saved dataset '{path}' has no 'train' split (it has {splits}); add one")
        ds = ds["train"]
    return ds


def _load_hub(name: str) -> Any:
    datasets = import_extra("datasets", needed_by=f"data.path: a hub dataset ('{name}')", extra=DATA_EXTRA)

    try:
        return datasets.load_dataset(name, split="train")
    except Exception as err:  # noqa: BLE001 - any loader failure is a bad data.path for the user
        raise ConfigError(
            f"data.path: could not load hub dataset '{name}' ({type(err).__name__}: {err}); "
            "check the name and network, or point data.path at local files"
        ) from None


def _stdlib_documents() -> Iterator[str]:
    for file in _stdlib_files():
        try:
            yield file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _all_documents(path: str, field: str) -> Iterator[str]:
    if path == BUILTIN_CORPUS:
        yield from _stdlib_documents()
        return
    local = Path(path).expanduser()
    if _is_saved_dataset(local):
        yield from _read_dataset(_load_saved(local), field, str(local))
    elif local.is_dir():
        for file in _folder_files(local):
            yield from _read_file(file, field)
    elif local.is_file():
        yield from _read_file(local, field)
    else:
        yield from _read_dataset(_load_hub(path), field, f"hub dataset '{path}'")


def iter_documents(path: str, text_field: str = "text", max_documents: int | None = None) -> Iterator[str]:
    """Yield the non-empty documents of ``path`` in a fixed order, at most ``max_documents`` of them."""
    count = 0
    if max_documents is not None and max_documents <= 0:
        return
    for doc in _all_documents(path, text_field):
        if not doc:
            continue
        yield doc
        count += 1
        if max_documents is not None and count >= max_documents:
            return


def _listing(root: Path, files: Iterable[Path]) -> str:
    parts = []
    for file in files:
        st = file.stat()
        parts.append(f"{file.relative_to(root).as_posix()}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def source_fingerprint(path: str) -> str:
    """A cheap string that changes when the data behind ``path`` changes."""
    if path == BUILTIN_CORPUS:
        return f"{BUILTIN_CORPUS}|{sys.version}|{sysconfig.get_paths()['stdlib']}"
    local = Path(path).expanduser()
    if not local.exists():
        return f"hub:{path}"
    local = local.resolve()
    if local.is_file():
        return f"file:{local}|{_listing(local.parent, [local])}"
    files = _folder_files(local)
    if _is_saved_dataset(local):
        files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: p.relative_to(local).as_posix())
    return f"dir:{local}|{_listing(local, files)}"
