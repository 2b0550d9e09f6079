"""What every rank of a save must agree on: that the checkpoint directory is one folder all ranks
share (checked at start-up), and the outcome of a step run on rank 0 or on every rank, so that a
failure on one rank stops all of them with the same error instead of leaving them in a collective."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from meshtron.errors import ConfigError, MeshtronError

if TYPE_CHECKING:
    from meshtron.distributed.runtime import Runtime


def _share(runtime: Runtime, value):
    """Rank 0's ``value`` (any picklable object) on every rank."""
    box = [value]
    if runtime.distributed:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(runtime: Runtime, value) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    if not runtime.distributed:
        return [value]
    values = [None] * runtime.world_size
    dist.all_gather_object(values, value)
    return values


def on_main(runtime: Runtime, action: Callable, fail: Callable[[str], MeshtronError]):
    """Run ``action`` on rank 0 and return its result on every rank; if it fails, raise ``fail(reason)``
    on every rank (the others would otherwise wait for rank 0 in the next collective until the timeout)."""
    outcome: tuple[Any, MeshtronError | None] = (None, None)
    if runtime.is_main:
        try:
            outcome = (action(), None)
        except OSError as err:
            outcome = (None, fail(str(err)))
    result, error = _share(runtime, outcome)
    if error is not None:
        raise error
    return result


def on_every_rank(runtime: Runtime, action: Callable, fail: Callable[[str], MeshtronError]) -> None:
    """Run ``action`` on every rank; if it fails on any, raise ``fail(first reason)`` on every rank."""
    reason = None
    try:
        action()
    except (OSError, RuntimeError) as err:  # torch.save raises RuntimeError for a missing folder
        reason = f"rank {runtime.rank}: {err}"
    reasons = [r for r in _gather(runtime, reason) if r]
    if reasons:
        raise fail(reasons[0])


def _ranks_text(ranks: list[int], hosts: list[str]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    machines = sorted({hosts[r] for r in ranks})
    on = ", ".join(machines[:4]) + (", ..." if len(machines) > 4 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} (on {on})"


def check_shared_directory(directory: Path, probe: Path, runtime: Runtime) -> None:
    """Every rank writes ``probe/rank-<r>``; rank 0 must see them all, as a save has every rank write into
    the folder rank 0 creates. Raises the same ConfigError on every rank otherwise; removes ``probe``."""
    host = socket.gethostname()
    reason = None
    try:
        (probe / f"rank-{runtime.rank}").write_text(host)
    except OSError as err:
        reason = err.strerror or str(err)
    reports = _gather(runtime, (host, reason))  # also: every rank has written before rank 0 looks
    verdict = None
    if runtime.is_main:
        unseen = [r for r in range(runtime.world_size) if not (probe / f"rank-{r}").is_file()]
        if unseen and all(reports[r][1] is None for r in unseen):  # written: give a slow filesystem a moment
            time.sleep(1.0)
            unseen = [r for r in unseen if not (probe / f"rank-{r}").is_file()]
        shutil.rmtree(probe, ignore_errors=True)
        if unseen:
            why = next((reports[r][1] for r in unseen if reports[r][1]), None)
            verdict = ConfigError(
                f"checkpoint directory '{directory}' is not shared by all ranks: rank 0 (on {host}) does not see "
                f"the test files of {_ranks_text(unseen, [h for h, _ in reports])} there"
                + (f" ({why})" if why else "")
                + "; every rank writes into one checkpoint folder, so set "
                "checkpoint.dir (or run.output_dir) to a directory on a filesystem that all nodes share"
            )
    verdict = _share(runtime, verdict)
    if verdict is not None:
        raise verdict
