"""Whether a checkpoint on disk is whole: the manifest a save records and the checks a resume runs.

When a save commits, rank 0 lists every file of the checkpoint in ``meshtron.json``: its size (``files``) and
its zlib CRC-32 (``crc32``). Each rank computes the CRC-32 of the files it wrote itself, right after writing them
(an async save in its background thread), and rank 0 gathers them at the commit; rank 0 adds its own files
(``.metadata``, ``config.toml``) and any file no rank claimed.

Two checks use the manifest. ``damage`` (sizes; cheap, run by preflight before any collective and by the launcher)
finds a missing file or one of another size (a truncated write, a copy cut short, a disk that filled up after the
commit). ``content_damage`` (CRC-32; once the process group exists) finds bytes changed in place: rank 0 reads the
manifest and sends it, the files are split over the ranks by size, each rank reads its share once, and every rank
learns every rank's finding, so all take the same decision. ``checkpoint.resume=auto`` falls back to the newest
checkpoint that passes both and says which one it skipped; an explicit path is an error.

Checkpoints written before the checksums existed are checked for sizes only, and those written before the size
list existed for their metadata files only.
"""

from __future__ import annotations

import json
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from meshtron.checkpoint.shared_directory import _gather, _share

if TYPE_CHECKING:
    from meshtron.distributed.runtime import Runtime

META = "meshtron.json"
FILES = "files"
CHECKSUMS = "crc32"
"""meshtron.json's {relative path: zlib.crc32 of the file's bytes}."""
CHUNK_BYTES = 8 << 20
READERS = 4
"""Files one process checks at a time (zlib.crc32 and file reads release the GIL)."""


def file_manifest(directory: Path, skip: tuple[str, ...] = (META,)) -> dict[str, int]:
    """{relative path: size in bytes} of every file under ``directory`` (``skip``: names left out)."""
    return {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name not in skip
    }


def file_checksum(file: Path) -> int:
    """zlib.crc32 of ``file``'s bytes, read in pieces of CHUNK_BYTES."""
    crc = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as stream:
        while read := stream.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return crc


def checksums(directory: Path, names: list[str]) -> dict[str, int]:
    """{name: file_checksum} of the files ``names`` under ``directory``, READERS at a time."""
    if not names:
        return {}
    with ThreadPoolExecutor(min(len(names), READERS)) as pool:
        return dict(zip(names, pool.map(lambda name: file_checksum(directory / name), names)))


def files_written_by(directory: Path, rank: int, own: tuple[str, ...] = ()) -> list[str]:
    """The files of a save in ``directory`` that ``rank`` wrote: torch.distributed.checkpoint's ``__<rank>_*.distcp``
    (FileSystemWriter names a rank's files so) and ``own`` (its RNG state and other files of its own)."""
    tensors = sorted(path.name for path in directory.glob(f"__{rank}_*.distcp"))
    return tensors + [name for name in own if (directory / name).is_file()]


def share_of_files(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` checks when ``world_size`` ranks split ``sizes`` ({name: bytes}): largest first, each to
    the rank with the fewest bytes so far (ties: the lower rank). The same split on every rank."""
    loads = [0] * world_size
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        owner = min(range(world_size), key=lambda r: (loads[r], r))
        loads[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def recorded_checksums(path: Path) -> dict[str, tuple[int, int]]:
    """{name: (size, crc32)} that checkpoint ``path``'s meshtron.json recorded; empty for a checkpoint saved before
    checksums existed (or one whose meshtron.json is unreadable: ``damage`` says so)."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    sizes, crcs = meta.get(FILES, {}), meta.get(CHECKSUMS, {})
    if not isinstance(sizes, dict) or not isinstance(crcs, dict):
        return {}
    return {name: (_whole(sizes.get(name, 0)), _whole(crc)) for name, crc in crcs.items()}


def _whole(value) -> int:
    """``value``, or -1 where it is not a whole number (a hand-edited meshtron.json): no file's checksum equals it,
    so the file is reported as changed, on the rank that checks it, instead of that rank raising alone."""
    return value if isinstance(value, int) and value >= 0 else -1


def altered(path: Path, expected: dict[str, int]) -> str | None:
    """Why checkpoint ``path``'s files ``expected`` ({name: crc32}) are not as saved, or None when they are."""
    names = sorted(expected)
    if not names:
        return None
    with ThreadPoolExecutor(min(len(names), READERS)) as pool:
        found = dict(zip(names, pool.map(lambda name: _checksum_or_reason(Path(path) / name), names)))
    for name in names:
        checksum = found[name]
        if isinstance(checksum, str):
            return checksum
        if checksum != expected[name]:
            return f"{name} was changed after the save (crc32 {checksum:08x}, {expected[name]:08x} when saved)"
    return None


def _checksum_or_reason(file: Path) -> int | str:
    """``file_checksum(file)``, or why the file cannot be read."""
    try:
        return file_checksum(file)
    except OSError as err:
        return f"{file.name} cannot be read ({err.strerror or err})"


def damage(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be loaded as it is, in a few words, or None when it is whole (sizes only)."""
    path = Path(path)
    if not path.is_dir():
        return "the folder does not exist"
    if not (path / ".metadata").is_file():
        return "no .metadata (torch.distributed.checkpoint's index)"
    if not (path / META).is_file():
        return f"no {META}"
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"{META} is unreadable ({str(err).splitlines()[0]})"
    for name, size in sorted(meta.get(FILES, {}).items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        found = file.stat().st_size
        if found != size:
            return f"{name} has {found:,} bytes, {size:,} when saved"
    return None


def content_damage(path: Path, runtime: Runtime) -> str | None:
    """Whether checkpoint ``path``'s bytes are as saved (``altered``'s reason, or None), the same answer on every
    rank: every rank calls it and reads its share of the files (one process, or a rehearsal's, reads them all)."""
    if not runtime.distributed or runtime.rehearsal:  # a rehearsal's collectives move no data
        return altered(path, {name: crc for name, (_, crc) in recorded_checksums(path).items()})
    recorded = _share(runtime, recorded_checksums(path) if runtime.is_main else None)
    sizes = {name: size for name, (size, _) in recorded.items()}
    mine = share_of_files(sizes, runtime.rank, runtime.world_size)
    reasons = _gather(runtime, altered(path, {name: recorded[name][1] for name in mine}))
    return next((reason for reason in reasons if reason is not None), None)


def rank_checksums(directory: Path, rank: int, own: tuple[str, ...]) -> dict[str, int]:
    """{name: crc32} of the files ``rank`` wrote into a save's ``directory`` (``files_written_by``)."""
    return checksums(directory, files_written_by(directory, rank, own))


def manifest_checksums(directory: Path, sizes: dict[str, int], by_ranks: list[dict[str, int]]) -> dict[str, int]:
    """Every file's crc32 for meshtron.json: the ranks' own (``by_ranks``), and the rest (files of ``sizes`` no rank
    claimed: ``.metadata``, ``config.toml``) read here."""
    known = {name: crc for sums in by_ranks for name, crc in sums.items() if name in sizes}
    return {**known, **checksums(directory, [name for name in sizes if name not in known])}
