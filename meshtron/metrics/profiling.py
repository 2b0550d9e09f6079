"""Profiling a run's steps: torch profiler traces per rank with a time summary by category, and CUDA memory
snapshots (``run.profile_steps``, ``run.memory_snapshot_steps``; docs/profiling.md).

Each rank records the steps ``A-B`` (1-based, inclusive) with ``torch.profiler`` and writes
``<run.output_dir>/profile/rank-K.json``, a Chrome trace that Perfetto (ui.perfetto.dev) and chrome://tracing open.
Rank 0 logs a table of the recorded time by category: matmuls, attention, communication, optimizer, copies and
casts, and the rest.

- On a GPU (``summarize_kernels``) the table reads the trace back and counts only the GPU's own work: its kernel,
  memcpy and memset events, each by its kernel name (``kernel_category``), plus the GPU-busy share. Not the
  operators' device time: with compiled graphs torch's per-operator ``self_device_time_total`` counts kernels more
  than once (a 793 ms H100 trace summed to 1,629 ms that way).
- On CPU (``summarize_operators``, also a GPU run whose trace holds no GPU events) it counts the operators' own CPU
  time (each operator's time minus its children's, so that nothing is counted twice), by operator name
  (``category``).

Either way the categories add up to the total. ``bench/step_profile.py`` prints the same summary.

``run.memory_snapshot_steps`` records the CUDA caching allocator's history over its steps and writes
``<run.output_dir>/memory/rank-K.pickle`` (open it at pytorch.org/memory_viz); without a GPU there is nothing to
record, and rank 0 says so in one line.
"""

from __future__ import annotations

import gzip
import json
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
"""``copies`` holds copies and casts (memcpy, memset, aten's copy / dtype-conversion kernels, ``aten::copy_``...)."""

# Operators (the CPU summary). First match wins, in this order: a communication op is not a copy, an attention op
# is not a matmul.
_OPERATOR_PATTERNS = (
    (
        "communication",
        r"nccl|c10d|gloo|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|\bsend\b|\brecv\b",
    ),
    ("attention", r"attention|flash|fmha|flex"),
    ("matmul", r"gemm|cutlass|xmma|cublas|\b(aten::)?(mm|addmm|bmm|baddbmm|matmul|linear|_grouped_mm|_scaled_mm)\b"),
    ("copies", r"_foreach_copy_"),  # a list of copies (the master gradients', FSDP's copy-in), before _foreach
    ("optimizer", r"optimizer|adam|_foreach|zero_grad"),
    ("copies", r"copy|memcpy|memset|\baten::(cat|clone|contiguous|to|_to_copy|index_select|gather|scatter)\b"),
)
_OPERATOR_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in _OPERATOR_PATTERNS]

# GPU kernels (the GPU summary), first match wins. Inductor's kernels are named after the aten ops they fuse
# (``triton_poi_fused__to_copy_mul_3``): such a kernel is not a copy, so ``copies`` skips ``triton_*`` names; its
# templates are attention (``triton_tem_fused_flex_attention_backward_*``) or matmuls (``triton_tem_fused_mm_0``).
_KERNEL_PATTERNS = (
    ("communication", r"nccl|(?<![a-z])all_?(reduce|gather|to_?all)|reduce_?scatter"),  # symmetric memory's too
    ("attention", r"attention|attn|flash|fmha|sdpa|flex_"),  # before matmul: fmha_cutlassF is attention
    (
        "matmul",
        r"nvjet|gemm|gemv|cutlass|xmma|wgmma|cublas|splitkreduce|scaled_mm|grouped_mm"
        r"|^triton_tem_.*_(addmm|baddbmm|bmm|mm)(_|$)",
    ),
    ("copies", r"multi_tensor_apply_kernel.*CopyFunctor"),  # _foreach_copy_'s kernel, before the optimizer's
    ("optimizer", r"multi_tensor_apply|adam|_foreach_|lpnorm_cleanup|optimizer|fused_sgd"),
    ("copies", r"^(?!triton_)(.*(memcpy|memset|copy_kernel|catarraybatchedcopy))"),
)
_KERNEL_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in _KERNEL_PATTERNS]

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace event categories of the GPU's own work (kineto's names; the older ``Memcpy`` / ``Memset`` spellings too)."""
_GPU_WORK = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}
_COPY_EVENTS = {"gpu_memcpy", "gpu_memset", "memcpy", "memset"}
_WALL = _GPU_WORK | {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}
"""Events whose span is the recorded wall time: operators, annotations, runtime / driver calls and GPU work (not
the profiler's own ``Trace`` / ``overhead`` spans, nor flow arrows)."""


def category(name: str) -> str:
    """The summary category of a profiled operator (the CPU summary)."""
    for label, pattern in _OPERATOR_COMPILED:
        if pattern.search(name):
            return label
    return "other"


def kernel_category(name: str) -> str:
    """The summary category of a GPU kernel (or memcpy / memset) by its name: ``matmul`` (cuBLAS ``nvjet_*``,
    cutlass, gemm / gemv, xmma / wgmma, scaled and grouped mm, inductor's mm templates), ``attention`` (flash, flex,
    fmha, cuDNN SDPA), ``optimizer`` (``multi_tensor_apply`` and optimizer kernels), ``communication`` (NCCL),
    ``copies`` (memcpy, memset, aten's copy / cast kernels such as ``direct_copy_kernel`` and
    ``bfloat16_copy_kernel``; never inductor's fused ``triton_*`` kernels), else ``other``."""
    for label, pattern in _KERNEL_COMPILED:
        if pattern.search(name):
            return label
    return "other"


@dataclass
class ProfileSummary:
    times_us: dict[str, float]
    """Microseconds per category (CATEGORIES), over all the recorded steps."""
    device: str
    """``cuda``: GPU kernel, memcpy and memset time; ``cpu``: operators' own CPU time."""
    steps: int | None = None
    """How many steps were recorded, where known (the table then shows ms per step)."""
    busy_us: float | None = None
    """GPU only: the time at least one kernel, memcpy or memset ran (the union of their intervals)."""
    wall_us: float | None = None
    """GPU only: the recorded wall time, from the trace's first event to the end of its last (``summarize_kernels``)."""

    @property
    def total_us(self) -> float:
        return sum(self.times_us.values())

    @property
    def busy_share(self) -> float | None:
        """The GPU-busy share: busy time over the recorded wall time."""
        return self.busy_us / self.wall_us if self.busy_us is not None and self.wall_us else None

    def share(self, name: str) -> float:
        """A category's share of the total (the shares add up to 1)."""
        return self.times_us[name] / self.total_us if self.total_us else 0.0

    @property
    def basis(self) -> str:
        if self.device == "cuda":
            return "GPU time of kernels, memcpy and memset"
        return "CPU time of operators (own, children excluded; no GPU work recorded)"

    def busy_line(self) -> str | None:
        if self.busy_share is None:
            return None
        return (
            f"the GPU was busy {self.busy_share:.1%} of the {self.wall_us / 1e3:.1f} ms recorded "
            f"({self.busy_us / 1e3:.1f} ms with a kernel, memcpy or memset running)"
        )

    def table(self, heading: str) -> str:
        """The log's table: ``heading`` says what was recorded (e.g. ``profile of steps 5-7 on rank 0``)."""
        steps = f", {self.steps} steps" if self.steps else ""
        lines = [f"meshtron: {heading}, {self.basis}{steps}:"]

        def row(name: str, micros: float, share: str) -> str:
            per_step = f"{micros / 1e3 / self.steps:>11.3f} ms/step" if self.steps else ""
            return f"  {name:<14}{micros / 1e3:>12.3f} ms{per_step}{share}"

        for name in CATEGORIES:
            lines.append(row(name, self.times_us[name], f" {self.share(name):>7.1%}"))
        lines.append(row("total", self.total_us, ""))
        busy = self.busy_line()
        if busy:
            lines.append(f"  {busy}")
        return "\n".join(lines)

    def markdown(self) -> str:
        """The same figures as a Markdown table, largest first (kind, ms per step where the steps are known, share),
        then the GPU-busy share."""
        steps = self.steps or 1
        unit = "ms per step" if self.steps else "ms"
        rows = [f"| kind | {unit} | share |", "| --- | ---: | ---: |"]
        for name in sorted(CATEGORIES, key=lambda name: -self.times_us[name]):
            rows.append(f"| {name} | {self.times_us[name] / 1e3 / steps:.1f} | {self.share(name):.1%} |")
        rows.append(f"| total | {self.total_us / 1e3 / steps:.1f} | 100.0% |")
        busy = self.busy_line()
        if busy:
            rows += ["", f"{busy[0].upper()}{busy[1:]}."]
        return "\n".join(rows)


def load_trace(path) -> list[dict]:
    """The events of a Chrome trace that ``export_chrome_trace`` wrote (``.json``, or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize_kernels(events, steps: int | None = None) -> ProfileSummary:
    """The GPU summary of a Chrome trace's ``events`` (``load_trace``; complete events, ``"ph": "X"``, with
    ``"ts"`` / ``"dur"`` in microseconds): only the GPU's own work counts, its kernels (``"cat": "kernel"``, by
    ``kernel_category`` of their name) and its memcpy and memset events (``copies``); CPU operators, runtime calls
    and annotations do not.

    ``busy_us`` is the union of those events' intervals, so that kernels overlapping on several streams count once;
    ``wall_us`` runs from the start of the trace's first operator, annotation, CUDA runtime / driver call or GPU event
    to the end of its last one (for ``run.profile_steps``, the recorded steps: the CPU launching them until the GPU
    finishes them). Their ratio is the GPU-busy share. ``steps``: how many steps the trace holds, where known."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    intervals: list[tuple[float, float]] = []
    first, last = float("inf"), float("-inf")
    for event in events:
        kind = str(event.get("cat", "")).lower()
        if event.get("ph") != "X" or kind not in _WALL:
            continue
        start = float(event["ts"])
        duration = float(event.get("dur", 0.0))
        first, last = min(first, start), max(last, start + duration)
        if kind in _GPU_WORK:
            label = "copies" if kind in _COPY_EVENTS else kernel_category(str(event.get("name", "")))
            times[label] += duration
            intervals.append((start, start + duration))
    if not intervals:
        return ProfileSummary(times, "cuda", steps)
    return ProfileSummary(times, "cuda", steps, busy_us=_union_us(intervals), wall_us=last - first)


ENCLOSING = ("communication", "attention", "optimizer")
"""Categories that claim the operators they call: a matmul inside attention (SDPA on CPU) is attention's time, a
copy inside a collective communication's, a foreach kernel inside ``Optimizer.step`` the optimizer's."""


def summarize_operators(events, steps: int | None = None) -> ProfileSummary:
    """The CPU summary: the profiled operators' own CPU time (their time minus their children's) by ``category``;
    ``events`` is ``profiler.events()`` (torch's FunctionEvent list). An operator counts in the category of its
    outermost enclosing ENCLOSING operator, else in its own."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        spent = event.self_cpu_time_total
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
            label = category(event.name)
        times[label] += spent
    return ProfileSummary(times, "cpu", steps)


def summarize_profile(profiler, trace_path, device: torch.device | str, steps: int | None = None) -> ProfileSummary:
    """The summary of a finished ``torch.profiler.profile`` whose Chrome trace is at ``trace_path``: on CUDA the
    trace's GPU work (``summarize_kernels``; not yet run on a GPU from here, its counting is tested on a recorded
    H100 trace), else, or where the trace holds no GPU events, the operators' CPU time (``summarize_operators``)."""
    if torch.device(device).type == "cuda":
        summary = summarize_kernels(load_trace(trace_path), steps)
        if summary.busy_us is not None:
            return summary
    return summarize_operators(profiler.events(), steps)


class StepProfiler:
    """Starts and stops the profiler and the memory history around the configured steps (every rank)."""

    def __init__(self, run: RunConfig, output_dir: Path, rank: int, device: torch.device):
        """``run``: the ``[run]`` settings (``profile_steps``, ``memory_snapshot_steps``)."""
        self.profile = parse_step_range("run.profile_steps", run.profile_steps)
        self.memory = parse_step_range("run.memory_snapshot_steps", run.memory_snapshot_steps)
        self.output_dir, self.rank, self.device = Path(output_dir), rank, device
        self._profiler: torch.profiler.profile | None = None
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
        trace = directory / f"rank-{self.rank}.json"
        profiler.export_chrome_trace(str(trace))
        steps = self.profile[1] - self.profile[0] + 1
        self.summary = summarize_profile(profiler, trace, self.device, steps)
        message(self.summary.table(f"profile of steps {self.profile[0]}-{self.profile[1]} on rank 0"))
        message(f"meshtron: profiler traces in {directory}/ (rank-K.json; open in ui.perfetto.dev)")

    def close(self) -> None:
        """A run that ends (or fails) inside the ranges stops recording."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
