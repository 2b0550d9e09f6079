"""What ``meshtron check`` prints: the environment, one table row per layout as it finishes, a closing verdict."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass

from meshtron.check.compare import Comparison

COLUMNS = (
    f"{'layout':<22} {'ranks':>5} {'loss':>9} {'grad norm':>9} {'weights':>9} {'max abs':>9} {'result':>6} {'s':>6}"
)
LEGEND = (
    "(largest relative difference from one process over the steps and ranks; weights: the worst tensor's relative "
    "L2 difference, max abs: its largest element's)"
)


@dataclass
class Row:
    name: str
    ranks: int
    seconds: float
    comparison: Comparison | None = None
    error: str | None = None
    """Why the run gave nothing to compare (a rank failed, a timeout)."""
    what: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None and self.comparison is not None and self.comparison.passed

    @property
    def result(self) -> str:
        return "pass" if self.passed else "ERROR" if self.error else "FAIL"

    def line(self) -> str:
        c = self.comparison
        numbers = (
            [f"{value:>9.1e}" for value in (c.loss, c.grad_norm, c.weight_rel_l2, c.weight_max_abs)]
            if c is not None
            else [f"{'-':>9}"] * 4
        )
        line = f"{self.name:<22} {self.ranks:>5} {' '.join(numbers)} {self.result:>6} {self.seconds:>6.1f}"
        if self.error:
            return f"{line}  {self.error}"
        if c is not None and not c.passed:
            return f"{line}  differs: {'; '.join(c.problems)}"
        return line


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from meshtron import __version__

    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "not installed"
    return (
        f"meshtron {__version__}, torch {torch.__version__}, transformers {transformers}, "
        f"python {platform.python_version()}"
    )


def _nvidia_smi(*args: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def environment_lines(device: str, nproc: int) -> list[str]:
    """Backend, versions, devices and (where nvidia-smi is present) the GPUs' topology."""
    import torch

    lines = [_versions()]
    if device == "cuda":
        try:
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = "unknown"
        driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
        lines.append(
            f"backend nccl {nccl}, CUDA {torch.version.cuda}"
            + (f", driver {driver.splitlines()[0]}" if driver else "")
            + ", fp32 with TF32 off"
        )
        names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append("devices: " + ", ".join(f"{count} x {name}" for name, count in names.items()))
    else:
        processor = platform.processor() or platform.machine()
        lines.append(f"backend gloo on CPU ({os.cpu_count()} cores, {processor}), fp32")
    topology = _nvidia_smi("topo", "-m")
    if topology:
        lines.append("nvidia-smi topo -m:")
        lines += ["  " + line for line in topology.splitlines()]
    return lines


def verdict(rows: list[Row], device: str, kept: str | None) -> list[str]:
    """The closing lines: all match, or which differ and where to look."""
    bad = [row for row in rows if not row.passed]
    if not bad:
        return [f"all {len(rows)} layouts match one process"]
    named = ", ".join(f"{row.name} ({row.error or ', '.join(row.comparison.problems)})" for row in bad)
    lines = [f"{len(bad)} of {len(rows)} layouts differ: {named}"]
    multi = [row for row in rows if row.ranks > 1]
    if any(row.error for row in bad):
        lines.append(
            "  an ERROR is a rank that failed or hung: read its log"
            + (f" under {kept}/<run>/rank<R>.log" if kept else "")
            + (
                "; a timeout is a collective that never completed: rerun that layout with NCCL_DEBUG=INFO "
                "(--only NAME) and check the network interfaces (NCCL_SOCKET_IFNAME) and peer-to-peer access "
                "(NCCL_P2P_DISABLE=1 tells whether P2P is at fault)"
                if device == "cuda"
                else ""
            )
        )
    for row in bad:
        if row.what and row.comparison is not None:
            lines.append(
                f"  {row.name}: {row.what}"
                + (": check the driver and CUDA, and ECC errors (nvidia-smi -q -d ECC)" if device == "cuda" else "")
            )
    compared_multi = [row for row in bad if row.ranks > 1 and row.comparison is not None]
    if len(compared_multi) > 1 and len(compared_multi) == len(multi):  # one layout alone says nothing of the others
        lines.append(
            "  every multi-process layout differs: suspect the collectives themselves"
            + (
                " (NCCL, the interconnect: run nccl-tests' all_reduce_perf with -c 1 to check results)"
                if device == "cuda"
                else ""
            )
        )
    elif compared_multi:
        lines.append(
            "  only some layouts differ: their parallelism computes wrongly here (meshtron, torch or this machine); "
            "report it to meshtron with this output and the logs"
        )
    if kept:
        lines.append(f"  the runs' logs and results are kept in {kept}")
    return lines
