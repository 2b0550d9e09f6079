"""The standing one-GPU queue: every path that README.md's status table says has never run on a GPU, checked in one
call on a machine with one CUDA GPU (BENCHMARKS.md, "The one-GPU queue").

Each check is one small function (``gpu_kernels.py``, ``gpu_training.py``) run in its own process with its own
time limit; it compares the GPU with the CPU, float64 or the planner and returns the figures that matter. The queue
runs them in priority order within ``--budget`` seconds (9 minutes: one device call), prints pass / fail / skip per
check and rewrites one JSON of results after each. Without a GPU the CUDA checks skip with a reason and the few
that make sense on a CPU run small.

    python bench/one_gpu_checks/gpu_queue.py [--only NAME ...] [--json OUT] [--write-benchmarks] [--list]
    python bench/one_gpu_checks/gpu_queue.py --write-benchmarks --from-json RESULTS.json   # a GPU's results, here

``--write-benchmarks`` writes each check's last result into BENCHMARKS.md between its markers. ``tests/
test_one_gpu_checks.py`` runs the queue on CPU and keeps the registry and README.md's "never run" rows in step.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUDGET_S = 540
"""The whole queue's time: 9 minutes, inside one device call's 10."""


@dataclass(frozen=True)
class Check:
    """One check: ``target`` (``module:function`` of this folder, or ``FILE.py:function``) returns its figures,
    raises ``gpu_support.Skip`` or fails an assertion."""

    name: str
    target: str
    estimate_s: int
    """Seconds it is expected to take on one H100 or H200, its process's start included: measured on an H200 where it
    ran (2026-11-28; a check that failed part-way, its time so far plus what was left), an estimate elsewhere."""
    limit_s: int
    rows: tuple[str, ...] = ()
    """README.md status-table rows it checks: text of each row's first cell."""
    cuda: bool = True
    """Skipped without a CUDA GPU (False: it also runs, small, on a CPU)."""
    finding: str = ""
    """The issue finding it checks, for checks of a fix rather than of a row."""


CHECKS = (
    # Issue 59's preference objectives: first, while their issue is open.
    Check("preference_dpo", "gpu_training:preference_dpo", 90, 180, ("Preference objectives",)),
    # Issue 60's distillation: a frozen teacher, the fused loss of both heads.
    Check("distill", "gpu_training:distill", 100, 200, ("Distillation (`train.objective=distill`",)),
    # found failing on the first run (an H200, 2026-11-28) and fixed: first, to re-run
    Check("fused_loss", "gpu_kernels:fused_loss", 15, 60, ("Mixed precision",), cuda=False),
    Check("varlen_attention", "gpu_kernels:varlen_attention", 20, 90, ("Document-masked attention",)),
    Check("tiled_mlp", "gpu_training:tiled_mlp", 45, 120, ("Tiled MLP",), finding="issue 56 finding 2"),
    Check(
        "pp_zero_bubble_offload",
        "gpu_training:pp_zero_bubble_offload",
        45,
        120,
        ("Activation offloading",),
        finding="issue 56 finding 5",
    ),  # fmt: skip
    Check("meshtron_check_nproc1", "gpu_training:meshtron_check_nproc1", 60, 150, ("`meshtron check [--nproc N]`",)),
    Check("cpu_offload_one_gpu", "gpu_training:cpu_offload_one_gpu", 90, 120, ("Model state in host memory",)),
    # never started yet
    Check(
        "gradient_widening",
        "gpu_kernels:gradient_widening",
        25,
        90,
        ("Mixed precision",),
        finding="issue 61: the gradients' bf16 -> float32 copy",
    ),  # fmt: skip
    Check("muon", "gpu_training:muon", 20, 90, ("Muon",)),
    Check("lora", "gpu_training:lora", 20, 90, ("LoRA fine-tuning",)),
    Check("validation", "gpu_training:validation", 20, 90, ("Validation",)),
    Check("prefetch_pinning", "gpu_training:prefetch_pinning", 20, 90, ("Weighted data mixtures",)),
    Check("rope_scaling_long", "gpu_kernels:rope_scaling_long", 30, 120, ("Longer context",)),
    Check("nccl_start_up", "gpu_training:nccl_start_up", 20, 60, ("Faults",), finding="issue 43 findings 1 and 6"),
    Check("cp_hybrid_rehearsal", "gpu_training:cp_hybrid_rehearsal", 30, 120, ("Context parallelism",)),
    Check("float8_rowwise", "gpu_training:float8_rowwise", 50, 150, ("Float8 training",)),
    Check(
        "compiled_llama1b",
        "gpu_training:compiled_llama1b",
        130,
        240,
        ("`meshtron plan`: per-rank memory", "Mixed precision", "Profiling"),
    ),  # fmt: skip
    # passed on the first run
    Check(
        "forked_nproc1_torchao",
        "gpu_training:forked_nproc1_torchao",
        50,
        120,
        ("Forked workers",),
        finding="issue 56 finding 1",
    ),  # fmt: skip
    Check("cp_ring_tiles", "gpu_kernels:cp_ring_tiles", 15, 90, ("Context parallelism",), cuda=False),
    Check(
        "activation_offload",
        "gpu_training:activation_offload",
        35,
        120,
        ("Activation offloading",),
        finding="issue 56 finding 3",
    ),  # fmt: skip
    Check(
        "tp_compiled_offload",
        "gpu_training:tp_compiled_offload",
        45,
        150,
        ("Activation offloading",),
        finding="issue 56 finding 4",
    ),  # fmt: skip
)
"""In priority order: the queue stops starting checks when its budget is spent."""

NOT_THE_QUEUES = {
    "`meshtron check [--nproc N]`": "several GPUs over NCCL (its one-GPU run is meshtron_check_nproc1)",
    "Mixture of experts": "NCCL all-to-all between GPUs (the local grouped GEMMs ran on one H200)",
    "Seeing runs": "W&B online needs the network",
    "Several machines": "multi-node and SLURM",
    "Faults": "several GPUs, several machines, SLURM (the 1-rank NCCL parts are nccl_start_up)",
}
"""README.md rows whose "never run" part one GPU cannot check, and why."""

NEVER_RUN = re.compile(r"never run|not yet measured on a GPU", re.I)
BEGIN, END = "<!-- one-gpu-checks:begin -->", "<!-- one-gpu-checks:end -->"


def status_rows(readme: str) -> dict[str, str]:
    """README.md's status table: {first cell: second cell}."""
    section = readme.split("## Status", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| (.*?) \| (.*) \|$", line)
        if match and match[1] not in ("capability", "---"):
            rows[match[1]] = match[2]
    return rows


def coverage_problems(readme: str, checks=CHECKS, outside=NOT_THE_QUEUES) -> list[str]:
    """What keeps the registry and README.md's never-run rows apart: a row with no check and not marked as
    outside one GPU, and a check or mark whose row is not in the table (or matches several)."""
    rows = status_rows(readme)
    problems = []
    claims = [(f"check {c.name}", key) for c in checks for key in c.rows]
    claims += [("NOT_THE_QUEUES", key) for key in outside]
    for who, key in claims:
        matching = [row for row in rows if key in row]
        if len(matching) != 1:
            problems.append(f"{who} names README row '{key}', which matches {len(matching)} rows of the status table")
    claimed = {key for _, key in claims}
    for row, state in rows.items():
        if NEVER_RUN.search(state) and not any(key in row for key in claimed):
            problems.append(
                f"README row '{row[:60]}' says '{NEVER_RUN.search(state)[0]}' and no check names it: add a check "
                "to bench/one_gpu_checks/gpu_queue.py's CHECKS (rows=...) or, if one GPU cannot check it, to "
                "NOT_THE_QUEUES"
            )
    return problems


def _load(target: str):
    module_name, function = target.rsplit(":", 1)
    sys.path.insert(0, str(HERE))
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, function)


def run_child(target: str, result_path: str, out_dir: str) -> int:
    """In the check's own process: run ``target`` and write {status, reason, figures}."""
    from gpu_support import FIGURES, Skip

    result = {"status": "pass", "reason": "", "figures": {}}
    try:
        result["figures"] = _load(target)(Path(out_dir)) or {}
    except Skip as skip:
        result.update(status="skip", reason=str(skip))
    except AssertionError as failure:
        result.update(status="fail", reason=str(failure) or f"assertion failed ({_where(failure)})", figures=FIGURES)
    except Exception as error:  # noqa: BLE001 - a crash is the check's result
        result.update(status="fail", reason=f"{type(error).__name__}: {error} ({_where(error)})", figures=FIGURES)
    Path(result_path).write_text(json.dumps(result, default=str))
    return 0


def _where(error: BaseException) -> str:
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(f"{Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}")
        tb = tb.tb_next
    return frames[-1] if frames else "?"


def cuda_available() -> bool:
    """Whether the CUDA checks run (``GPU_QUEUE_ON_CPU=1`` runs them on the CPU: gpu_support.ON_CPU)."""
    import torch

    return torch.cuda.is_available() or os.environ.get("GPU_QUEUE_ON_CPU") == "1"


def machine() -> dict:
    """What the results were measured on."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit.stdout.strip() or "unknown",
    }


def run_check(check: Check, out_dir: Path, limit_s: float, has_cuda: bool) -> dict:
    """``check`` in its own process, killed (with its children) after ``limit_s``; its result row."""
    row = {"name": check.name, "status": "skip", "reason": "", "figures": {}, "seconds": 0.0}
    row.update(limit_s=check.limit_s, rows=list(check.rows), finding=check.finding)
    if check.cuda and not has_cuda:
        row["reason"] = "needs a CUDA GPU"
        return row
    folder = out_dir / check.name
    folder.mkdir(parents=True, exist_ok=True)
    result_path, log_path = folder / "result.json", folder / "log.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", check.target, str(result_path), str(folder)]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    row["seconds"] = round(time.perf_counter() - started, 1)
    if result_path.exists():
        row.update(json.loads(result_path.read_text()))
    elif row["seconds"] >= limit_s:
        cut = f" (the queue's budget left; its limit is {check.limit_s} s)" if limit_s < check.limit_s else ""
        row.update(status="fail", reason=f"timed out after {limit_s:.0f} s{cut} (log: {log_path})")
    else:
        tail = " | ".join(log_path.read_text().strip().splitlines()[-4:])
        row.update(status="fail", reason=f"its process exited {child.returncode} without a result: {tail}")
    return row


def run_queue(checks, out_dir: Path, json_path: Path, budget_s: float = BUDGET_S, report=print) -> dict:
    """Every check in order within ``budget_s``; the results (also written to ``json_path`` after each check)."""
    results = {**machine(), "budget_s": budget_s, "checks": []}
    has_cuda = cuda_available()
    started = time.perf_counter()
    for check in checks:
        left = budget_s - (time.perf_counter() - started)
        runs_here = has_cuda or not check.cuda  # the others skip at once: "needs a CUDA GPU"
        if runs_here and check.estimate_s > left:
            row = {"name": check.name, "status": "skip", "figures": {}, "seconds": 0.0, "rows": list(check.rows)}
            row.update(finding=check.finding, limit_s=check.limit_s)
            row["reason"] = f"not started: {left:.0f} s of the queue's budget left (estimate {check.estimate_s} s)"
        else:
            row = run_check(check, out_dir, min(check.limit_s, left), has_cuda)
        results["checks"].append(row)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        report(f"{row['status']:>4}  {check.name:<24} {row['seconds']:>6.1f} s  {row['reason'] or _figures(row)}")
    counts = {status: sum(r["status"] == status for r in results["checks"]) for status in ("pass", "fail", "skip")}
    report(f"one-GPU queue on {results['device']} (torch {results['torch']}): {counts} -> {json_path}")
    return results


def _figures(row: dict) -> str:
    def short(value):
        if isinstance(value, float):
            return f"{value:.3g}"
        if isinstance(value, list):
            return "[" + ", ".join(short(v) for v in value) + "]"
        return str(value)

    return "; ".join(f"{key} {short(value)}" for key, value in row.get("figures", {}).items())


def benchmarks_section(results: dict, previous: str, checks=CHECKS) -> str:
    """The text between BENCHMARKS.md's markers: one row per check, its last pass / fail (a check skipped this time
    keeps its previous row; one never run says so)."""
    old = {}
    for line in previous.splitlines():
        match = re.match(r"^\| `([a-z0-9_]+)` \|", line)
        if match:
            old[match[1]] = line
    rows = {row["name"]: row for row in results["checks"]}
    lines = [
        "",
        "| check | result | figures | date | device | torch |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for check in checks:
        row = rows.get(check.name)
        if row is not None and row["status"] in ("pass", "fail"):
            detail = _figures(row) if row["status"] == "pass" else row["reason"]
            cells = [f"`{check.name}`", row["status"], detail.replace("|", "/"), results["date"], results["device"]]
            lines.append("| " + " | ".join(cells + [results["torch"]]) + " |")
        elif check.name in old:
            lines.append(old[check.name])
        else:
            lines.append(f"| `{check.name}` | not yet run on a GPU | | | | |")
    return "\n".join(lines) + "\n"


def write_benchmarks(results: dict, path: Path, checks=CHECKS) -> None:
    """Replace the text between BENCHMARKS.md's queue markers by each check's last result."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"gpu_queue.py: {path} has no '{BEGIN}' ... '{END}' markers to write the results between")
    head, rest = text.split(BEGIN, 1)
    previous, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + benchmarks_section(results, previous, checks) + END + tail)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these checks only")
    parser.add_argument(
        "--json", type=Path, default=Path("runs/one-gpu-checks.json"), help="results file (runs/one-gpu-checks.json)"
    )
    parser.add_argument("--out", type=Path, help="the checks' run folders and logs (default: a temporary folder)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole queue ({BUDGET_S})")
    parser.add_argument("--write-benchmarks", action="store_true", help="write the results into BENCHMARKS.md")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="RESULTS",
        help="with --write-benchmarks: write RESULTS (a GPU's) instead of running",
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(*args.child)
    checks = CHECKS
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in CHECKS})
        if unknown:
            print(f"gpu_queue.py: --only: no check named {', '.join(unknown)}; --list lists them", file=sys.stderr)
            return 2
        checks = tuple(c for c in CHECKS if c.name in args.only)
    if args.list:
        for check in checks:
            print(f"{check.name:<24} ~{check.estimate_s:>3} s (limit {check.limit_s} s)  {check.finding or ''}")
        print(f"estimated total {sum(c.estimate_s for c in checks)} s; budget {args.budget:.0f} s")
        return 0
    if args.from_json:
        if not args.write_benchmarks:
            print("gpu_queue.py: --from-json only goes with --write-benchmarks", file=sys.stderr)
            return 2
        if not args.from_json.is_file():
            print(
                f"gpu_queue.py: --from-json: {args.from_json} is not a file; give the JSON a GPU run wrote",
                file=sys.stderr,
            )
            return 2
        write_benchmarks(json.loads(args.from_json.read_text()), REPO / "BENCHMARKS.md")
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="one-gpu-checks-"))
    results = run_queue(checks, out, args.json, args.budget)
    if args.write_benchmarks and results["device"] == "cpu":
        print("gpu_queue.py: --write-benchmarks: no GPU here, BENCHMARKS.md left as it is", file=sys.stderr)
    elif args.write_benchmarks:
        write_benchmarks(results, REPO / "BENCHMARKS.md")
    return 1 if any(r["status"] == "fail" for r in results["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
