"""Profiling a run's steps: torch profiler traces per rank with a time summary by category, and CUDA memory
snapshots (``run.profile_steps``, ``run.memory_snapshot_steps``; docs/profiling.md).

Each rank records the steps ``A-B`` (1-based, inclusive) with ``torch.profiler`` and writes
``<run.output_dir>/profile/rank-K.json``, a Chrome trace that Perfetto (ui.perfetto.dev) and chrome://tracing open.
Rank 0 logs a table of the recorded time by category: matmuls, attention, communication, optimizer, copies and the
rest. On CUDA the times are the GPU kernels' (their device time); on CPU the operators' own CPU time (each
operator's time minus its children's, so that nothing is counted twice): the categories add up to the total
(see ``summarize`` for how operators inside attention, collectives and the optimizer step are counted).

``run.memory_snapshot_steps`` records the CUDA caching allocator's history over its steps and writes
``<run.output_dir>/memory/rank-K.pickle`` (open it at pytorch.org/memory_viz); without a GPU there is nothing to
record, and rank 0 says so in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtron.config import RunConfig, parse_step_range

PROFILE_DIR = "profile"
MEMORY_DIR = "memory"
MEMORY_HISTORY_ENTRIES = 200_000
"""Allocator events kept by CUDA's memory history (older ones drop out of the snapshot)."""

CATEGORIES = ("matmul", "attention", "communication", "optimizer", "copies", "other")
# First match wins, in this order: a communication kernel is not a copy, an attention kernel is not a matmul.
_PATTERNS = (
    (
        "communication",
        r"nccl|c10d|gloo|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|\bsend\b|\brecv\b",
    ),
    ("attention", r"attention|flash|fmha|flex"),
    ("matmul", r"gemm|cutlass|xmma|cublas|\b(aten::)?(mm|addmm|bmm|baddbmm|matmul|linear|_grouped_mm|_scaled_mm)\b"),
    ("optimizer", r"optimizer|adam|_foreach|zero_grad"),
    ("copies", r"copy|memcpy|memset|\baten::(cat|clone|contiguous|to|_to_copy|index_select|gather|scatter)\b"),
)
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in _PATTERNS]


def category(name: str) -> str:
    """The summary category of a profiler event or kernel name."""
    for label, pattern in _COMPILED:
        if pattern.search(name):
            return label
    return "other"


@dataclass
class ProfileSummary:
    times_us: dict[str, float]
    """Microseconds per category (CATEGORIES)."""
    device: str
    """``cuda``: GPU kernel time; ``cpu``: operators' own CPU time."""

    @property
    def total_us(self) -> float:
        return sum(self.times_us.values())

    def table(self, steps: tuple[int, int]) -> str:
        what = "GPU kernel time" if self.device == "cuda" else "CPU time of operators (own, children excluded)"
        total = self.total_us or 1.0
        lines = [f"meshtron: profile of steps {steps[0]}-{steps[1]} on rank 0, {what}:"]
        for name in CATEGORIES:
            lines.append(f"  {name:<14}{self.times_us[name] / 1e3:>12.3f} ms {self.times_us[name] / total:>7.1%}")
        lines.append(f"  {'total':<14}{self.total_us / 1e3:>12.3f} ms")
        return "\n".join(lines)


ENCLOSING = ("communication", "attention", "optimizer")
"""Categories that claim the operators they call: a matmul inside attention (SDPA on CPU) is attention's time, a
copy inside a collective communication's, a foreach kernel inside ``Optimizer.step`` the optimizer's."""


def summarize(events, device: str) -> ProfileSummary:
    """Sum the profiled operators' own time by category: ``events`` is ``profiler.events()`` (torch's FunctionEvent
    list); on CUDA the device time of the kernels each operator launched, on CPU its CPU time minus its children's.
    An operator counts in the category of its outermost enclosing ENCLOSING operator, else in its own."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        spent = getattr(event, "self_device_time_total", 0.0) if device == "cuda" else event.self_cpu_time_total
        if spent <= 0:
            continue
        label = None
        parent = event.cpu_parent
        while parent is not None:
            enclosing = category(parent.name)
            if enclosing in ENCLOSING:
                label = enclosing  # keep going: the outermost one wins
            parent = parent.cpu_parent
        if label is None:
            kernels = " ".join(kernel.name for kernel in getattr(event, "kernels", []))
            label = category(f"{event.name} {kernels}")
        times[label] += spent
    return ProfileSummary(times, device)


class StepProfiler:
    """Starts and stops the profiler and the memory history around the configured steps (every rank)."""

    def __init__(self, run: RunConfig, output_dir: Path, rank: int, device: torch.device):
        """``run``: the ``[run]`` settings (``profile_steps``, ``memory_snapshot_steps``)."""
        self.profile = parse_step_range("run.profile_steps", run.profile_steps)
        self.memory = parse_step_range("run.memory_snapshot_steps", run.memory_snapshot_steps)
        self.output_dir, self.rank, self.device = Path(output_dir), rank, device
        self._profiler = None
        self._recording_memory = False
        self.summary: ProfileSummary | None = None

    def before_step(self, step: int, message) -> None:
        """Before 0-based ``step``; ``message``: the logger's message function (rank 0 prints)."""
        number = step + 1
        if self.profile is not None and number == self.profile[0] and self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        if self.memory is not None and number == self.memory[0]:
            if self.device.type != "cuda":
                message(
                    f"meshtron: run.memory_snapshot_steps={self.memory[0]}-{self.memory[1]}: CUDA memory snapshots "
                    f"need a GPU; this run is on {self.device.type}, nothing recorded"
                )
            elif not self._recording_memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
                self._recording_memory = True

    def after_step(self, step_number: int, message) -> None:
        """After ``step_number`` steps are done."""
        if self._profiler is not None and step_number == self.profile[1]:
            self._finish_profile(message)
        if self._recording_memory and step_number == self.memory[1]:
            directory = self.output_dir / MEMORY_DIR
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"rank-{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
            message(f"meshtron: CUDA memory snapshots of steps {self.memory[0]}-{self.memory[1]} in {directory}/")

    def _finish_profile(self, message) -> None:
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.stop()
        directory = self.output_dir / PROFILE_DIR
        directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(directory / f"rank-{self.rank}.json"))
        self.summary = summarize(profiler.events(), self.device.type)
        message(self.summary.table(self.profile))
        message(f"meshtron: profiler traces in {directory}/ (rank-K.json; open in ui.perfetto.dev)")

    def close(self) -> None:
        """A run that ends (or fails) inside the ranges stops recording."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
