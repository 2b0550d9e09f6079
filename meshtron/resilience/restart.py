"""Restarts after a failure: a restarted worker group continues the same run from its latest checkpoint.

torchrun's elastic agent (``torchrun --max-restarts N``, or ``meshtron train --nproc P --max-restarts N``,
which runs it) restarts every worker when any of them dies (killed, out of memory, a Python error on one
rank) and counts the restarts in ``TORCHELASTIC_RESTART_COUNT``. The restarted workers run the same command:
``checkpoint.resume=auto`` finds the latest complete checkpoint, the output directory is accepted as this
run's own even when no checkpoint exists yet, and the steps trained again after the restart are appended to
``metrics.jsonl`` with ``"restart": N`` (a reader takes the last row of each step; docs/faults.md).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0: the first start, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def last_logged_step(output_dir: Path) -> int:
    """The last step ``metrics.jsonl`` in ``output_dir`` has a row for (0 when none)."""
    path = Path(output_dir) / "metrics.jsonl"
    last = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError):  # a row cut short by the failure
                continue
    return last


def restart_message(count: int, resumed_from: Path | None, start_step: int, last_logged: int) -> str:
    """The log line of a restarted run: what it resumed from and how many logged steps are trained again."""
    source = (
        f"resumed from {resumed_from.name} (step {start_step})" if resumed_from else "no checkpoint yet: starting over"
    )
    lost = max(0, last_logged - start_step)
    return (
        f"meshtron: restart {count} of this run after a failure: {source}; {lost} step(s) logged before the "
        f"failure are trained again"
    )


def attempt_store(rank: int, world_size: int, timeout: timedelta):
    """The rendezvous store of a restarted worker group, with this attempt's keys apart from the failed ones'.

    torchrun's store outlives a restart, so the process group of a restarted group could read an address its
    failed predecessor published and try to connect to a dead process (seen with gloo: about every other
    restart failed with "connectFullMesh ... Connection refused"; pytorch/pytorch#167288 for NCCL). A prefix
    per attempt keeps them apart."""
    from torch.distributed import PrefixStore, TCPStore

    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts_it and rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    return PrefixStore(f"meshtron/attempt-{restart_count()}/", store)
