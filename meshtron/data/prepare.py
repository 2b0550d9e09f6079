"""Tokenize a corpus into a prepared directory (meshtron.data.shards), in parallel and in bounded memory.

The documents are read once, in their fixed order, and cut into shards of about ``shard_chars`` characters
(a shard ends after the document that reaches it). That cut depends only on the text, so the files are the
same whatever the number of workers. Each shard is tokenized whole by one worker (a process of its own when
``workers > 1``) and written chunk by chunk; at most ``workers + 1`` shards of text are in flight, so memory
is bounded by the shard size, not by the corpus. A killed prepare run again skips the shards it completed.
Several machines share the work with ``part=(i, n)``: each writes the shards ``k`` with ``k % n == i`` into
one shared directory, and whichever finds every shard complete writes the manifest.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterator

from meshtron.config import DataConfig
from meshtron.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ShardWriter,
    complete_shard,
    shard_name,
    token_dtype,
    write_json_atomically,
)
from meshtron.data.sources import iter_documents, source_fingerprint
from meshtron.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from meshtron.errors import ConfigError

ENCODE_CHUNK = 256
"""Documents encoded in one tokenizer call."""
DEFAULT_SHARD_CHARS = 64_000_000
SETTINGS = "prepare.json"
"""The settings of a prepare in progress, so that a resumed one can tell it continues the same work."""


def _shards(documents: Iterator[str], shard_chars: int) -> Iterator[tuple[int, list[str]]]:
    """(index of the first document, texts) of each shard, in order."""
    texts, chars, first, count = [], 0, 0, 0
    for doc in documents:
        texts.append(doc)
        chars += len(doc)
        count += 1
        if chars >= shard_chars:
            yield first, texts
            texts, chars, first = [], 0, count
    if texts:
        yield first, texts


def write_shard(directory: Path, index: int, first_document: int, texts: list[str], tokenizer) -> dict:
    """Tokenize ``texts`` (ENCODE_CHUNK at a time) into shard ``index``; returns its counts."""
    writer = ShardWriter(directory, index, token_dtype(tokenizer.vocab_size), tokenizer.eos_token_id, first_document)
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = texts[start : start + ENCODE_CHUNK]
        writer.add(tokenizer.encode_batch(chunk), sum(len(text) for text in chunk))
    return writer.close()


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(spec: str, trust_remote_code: bool):
    # One thread per worker process: the workers are the parallelism (a fast tokenizer would otherwise start a
    # thread per core in every worker). In one process (workers=1) it keeps its own threads.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_tokenizer(spec, trust_remote_code)


def _write_shard_in_worker(directory: Path, index: int, first: int, texts: list[str], spec: str, trust: bool) -> dict:
    return write_shard(directory, index, first, texts, _worker_tokenizer(spec, trust))


def _settings(data: DataConfig, tokenizer, shard_chars: int) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "source": {
            "path": data.path,
            "fingerprint": source_fingerprint(data.path),
            "text_field": data.text_field,
            "max_documents": data.max_documents,
        },
        "tokenizer": {
            "name": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_token_id": tokenizer.eos_token_id,
            "fingerprint": tokenizer_fingerprint(tokenizer),
        },
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "shard_chars": shard_chars,
    }


def _claim(out: Path, settings: dict) -> dict | None:
    """Check ``out`` can take this corpus; the existing manifest when it is already prepared, else None."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; give prepare a new or empty folder")
    for name, what in ((MANIFEST, "a corpus prepared"), (SETTINGS, "an unfinished prepare")):
        try:
            existing = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
        if {k: existing.get(k) for k in settings} != settings:
            raise ConfigError(
                f"--out {out} holds {what} from other data or settings (source "
                f"{existing.get('source', {}).get('path')!r}, "
                f"tokenizer {existing.get('tokenizer', {}).get('name')!r}); choose another --out or remove that folder"
            )
        if name == MANIFEST:
            return existing
    if out.is_dir() and any(not p.name.startswith(("shard-", ".")) and p.name != SETTINGS for p in out.iterdir()):
        raise ConfigError(f"--out {out} is a folder with other files in it; give prepare an empty or new folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create the folder ({err}); choose a writable path") from None
    write_json_atomically(out / SETTINGS, settings)
    return None


def _release(out: Path, created: bool) -> None:
    """After a prepare that failed before writing any shard: remove its settings (and the folder when it made it),
    so that the same command with the input fixed starts afresh instead of finding an unfinished prepare."""
    if any(out.glob("shard-*")):
        return  # work to resume
    (out / SETTINGS).unlink(missing_ok=True)
    if created and not any(out.iterdir()):
        out.rmdir()


def prepare_corpus(
    data: DataConfig,
    out: str | Path,
    *,
    tokenizer=None,
    workers: int = 1,
    shard_chars: int = DEFAULT_SHARD_CHARS,
    part: tuple[int, int] = (0, 1),
    trust_remote_code: bool = False,
    log: Callable[[str], None] = lambda line: None,
) -> dict | None:
    """Prepare ``data.path`` tokenized by ``data.tokenizer`` into ``out``; returns the manifest, or None when
    other parts (``part=(i, n)``) still have shards to write."""
    if workers < 1:
        raise ConfigError(f"--workers must be 1 or more, got {workers}")
    index_of_part, parts = part
    if not 0 <= index_of_part < parts:
        raise ConfigError(f"--part must be i/n with 0 <= i < n, got {index_of_part}/{parts}")
    out = Path(out).expanduser()
    tokenizer = tokenizer or load_tokenizer(data.tokenizer, trust_remote_code)
    settings = _settings(data, tokenizer, shard_chars)
    created = not out.exists()
    existing = _claim(out, settings)
    if existing is not None:
        log(f"meshtron: {out} is already prepared ({existing['tokens']:,} tokens in {len(existing['shards'])} shards)")
        return existing

    started, shards, reused = time.perf_counter(), [], 0
    documents = iter_documents(data.path, data.text_field, data.max_documents)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
    pending: dict = {}  # future -> shard index
    try:
        for index, (first, texts) in enumerate(_shards(documents, shard_chars)):
            counts = complete_shard(out, index, first)
            shards.append(counts)
            if counts is not None:
                reused += 1
                continue
            if index % parts != index_of_part:
                continue
            if pool is None:
                shards[index] = write_shard(out, index, first, texts, tokenizer)
                continue
            while len(pending) > workers:  # bounded: at most workers + 1 shards of text in flight
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    shards[pending.pop(future)] = future.result()
            future = pool.submit(_write_shard_in_worker, out, index, first, texts, tokenizer.name, trust_remote_code)
            pending[future] = index
        for future, index in pending.items():
            shards[index] = future.result()
    except ConfigError:  # bad input (e.g. a document that cannot be read)
        _release(out, created)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    done = [counts for counts in shards if counts is not None]
    log(
        f"meshtron: prepared {len(done) - reused} shard(s) in {time.perf_counter() - started:.1f} s"
        + (f", {reused} already complete from an earlier run" if reused else "")
    )
    if len(done) < len(shards):
        missing = [shard_name(i) for i, counts in enumerate(shards) if counts is None]
        log(
            f"meshtron: {len(missing)} shard(s) are left to the other parts ({missing[0]}, ...); the part that "
            "finishes last writes the manifest"
        )
        return None
    manifest = {
        **settings,
        "shards": shards,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
    }
    write_json_atomically(out / MANIFEST, manifest)
    (out / SETTINGS).unlink(missing_ok=True)
    return manifest
