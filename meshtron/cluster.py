"""Launches across machines: which nodes a job has, from SLURM's environment or the command line.

``meshtron train --nproc P`` on each node of a job starts P workers there and joins the other nodes' launchers
through torch's c10d rendezvous. Under ``srun`` in a SLURM job of several nodes it reads everything from the
environment (``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_ID``, ``SLURM_GPUS_ON_NODE``);
elsewhere ``--nnodes N --rdzv-endpoint HOST:PORT`` say the same (see docs/multi-node.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from meshtron.errors import ConfigError

BASE_PORT = 29400
"""Rendezvous port under SLURM: BASE_PORT + job id % 1000 (two jobs sharing a first node rarely collide)."""


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list -> host names: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1;
    several bracket groups multiply (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2); zero padding is kept."""
    hosts = []
    for item in _split_top_level(hostlist.strip()):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for value in _expand_ranges(ranges, hostlist):
            hosts.extend(prefix + value + tail for tail in (expand_hostlist(rest) if rest else [""]))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    values: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError(f"SLURM_JOB_NODELIST '{hostlist}' is not a SLURM host list")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high or low) + 1))
    return values


@dataclass(frozen=True)
class Nodes:
    """The nodes of a multi-node launch, as torchrun's c10d rendezvous takes them."""

    count: int
    rank: int
    endpoint: str
    """HOST:PORT of the rendezvous (the first node)."""
    job_id: str
    procs_per_node: int | None = None
    """GPUs (or tasks) per node that the environment gives, when it does."""

    def launcher_args(self, nproc: int) -> list[str]:
        return [
            f"--nnodes={self.count}",
            f"--node-rank={self.rank}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.job_id}",
        ]


def slurm_nodes(env: Mapping[str, str], port: int | None = None) -> Nodes | None:
    """The job's nodes when this runs in a SLURM job of more than one node, else None."""
    if "SLURM_JOB_ID" not in env or int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1"))) <= 1:
        return None
    missing = [key for key in ("SLURM_JOB_NODELIST", "SLURM_NODEID") if key not in env]
    if missing:
        raise ConfigError(
            f"this SLURM job has several nodes but {', '.join(missing)} is not set: start meshtron "
            "with srun (one task per node), or pass --nnodes and --rdzv-endpoint yourself"
        )
    hosts = expand_hostlist(env["SLURM_JOB_NODELIST"])
    count = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", len(hosts))))
    job_id = env["SLURM_JOB_ID"]
    gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    per_node = int(gpus) if gpus and gpus.isdigit() else None
    if port is None:
        port = BASE_PORT + int(job_id) % 1000 if job_id.isdigit() else BASE_PORT
    return Nodes(count, int(env["SLURM_NODEID"]), f"{hosts[0]}:{port}", f"slurm-{job_id}", per_node)


def command_line_nodes(
    nnodes: int | None, node_rank: int | None, endpoint: str | None, rdzv_id: str | None
) -> Nodes | None:
    """The nodes given by ``--nnodes`` / ``--node-rank`` / ``--rdzv-endpoint`` / ``--rdzv-id``, or None."""
    if nnodes is None or nnodes == 1:
        if endpoint or node_rank:
            raise ConfigError("--rdzv-endpoint and --node-rank are for several nodes: add --nnodes N")
        return None
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {nnodes}")
    if not endpoint or ":" not in endpoint:
        raise ConfigError(
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the first node's address and a free port, "
            "the same on every node)"
        )
    return Nodes(nnodes, node_rank or 0, endpoint, rdzv_id or "meshtron")
