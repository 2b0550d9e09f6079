"""Every layout rehearsed on one GPU: rank slices of big layouts trained alone at their real shapes
(``meshtron.plan.rehearsal``, a fake process group), measured next to what meshtron's planner predicts for them.

A row per rehearsed rank: state (parameters + gradients + optimizer), activations kept for backward, peak
memory, and the step without communication (eager unless ``--compile``) against the planner's compute time.
``MEM!`` flags a memory figure more than 10% off the plan, ``TIME!`` a step more than 15% off (the planner times
only GPUs it knows; on CPU peak memory is the process's resident size and is not compared). Pipeline layouts
rehearse the first, a middle and the last stage and report the skew of peak memory across them
(``(max - min) / max``, measured and planned); the DPO layout trains a preference objective with a live reference
model (a frozen copy laid out like the policy, on ``meshtron check``'s pairs) and compares the reference's bytes too,
the distillation layout a student learning from a frozen teacher of another shape (its own shards and pipeline split,
in bf16) and compares the teacher's bytes; expert-parallel layouts rehearse balanced routing and the worst
case, every token routed to the rehearsed rank's experts by every rank (its received rows x ep), forced here by
a hook on the experts' forward and the count exchange.

Each rehearsal runs in a process forked from this one (nothing here touches the GPU); a layout that fails or runs
out of memory prints its error on its row and the run goes on. Rows print as they finish.

    python bench/rehearse_layouts.py --json $OUT/rehearse.json            # every layout, 2 steps each (one GPU)
    python bench/rehearse_layouts.py --only tp8,ep8-qwen3moe --steps 3
    python bench/rehearse_layouts.py --tiny --only tp8,pp8-1F1B            # tiny shapes on the CPU (the test)
    python bench/rehearse_layouts.py --list
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.15
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    ranks: tuple[int, ...]
    overrides: tuple[str, ...]
    routing: tuple[str, ...] = ("balanced",)
    """Expert parallelism: ``balanced`` (the rehearsal's all-to-all), ``worst`` (every token to this rank's experts)."""
    tiny: dict = field(default_factory=dict)
    """The --tiny variant: ``world``, ``ranks`` and ``overrides`` (tiny presets and shapes, CPU)."""
    max_positions: int | None = None
    """The preset's max_position_embeddings raised to this (rotary positions only; the shapes of every weight are
    the preset's): llama-8b's preset says 8192 (Llama 3), the context-parallel rows rehearse 32768 tokens."""
    pairs: bool = False
    """Trains DPO with a frozen-copy reference on preference pairs (meshtron.check.layouts.write_pairs) instead of the
    corpus."""


def _llama8b(seq: int, batch: int) -> tuple[str, ...]:
    return ("--model.preset=llama-8b", f"--data.seq_len={seq}", f"--train.global_batch_size={batch}")


TINY = ("--model.preset=llama-tiny", "--data.seq_len=64", "--train.global_batch_size=4")
TINY_DEEP = ("--model.preset=llama-deep", "--data.seq_len=32", "--train.global_batch_size=4")
QWEN3MOE = ("--model.preset=qwen3moe-30b-a3b", "--data.seq_len=4096", "--train.global_batch_size=32")
DEEPSEEK = ("--model.preset=deepseekv3-small", "--data.seq_len=4096", "--train.global_batch_size=8")
TINY_QWEN3MOE = ("--model.preset=qwen3moe-tiny", "--data.seq_len=32", "--train.global_batch_size=4")
TINY_DEEPSEEK = ("--model.preset=deepseekv3-tiny", "--data.seq_len=32", "--train.global_batch_size=4")
EP_ROUTING = ("balanced", "worst")
_DISTILL = ("--train.objective=distill", "--distill.teacher_dtype=bfloat16")
_LLAMA1B_FROM_8B = ("--model.preset=llama-1b", "--distill.teacher=llama-8b", *_DISTILL)
"""Distillation: a llama-1b student (fp32 master weights) from a frozen llama-8b teacher stored in bf16."""
TINY_FROM_SMALL = (*TINY, "--distill.teacher=llama-small", *_DISTILL)

LAYOUTS = [
    Layout(
        "fsdp8",
        8,
        (0,),
        (*_llama8b(4096, 8), "--parallel.dp_shard=8"),
        tiny=dict(world=2, ranks=(0,), overrides=(*TINY, "--parallel.dp_shard=2")),
    ),
    Layout(
        "hsdp2x4",
        8,
        (0,),
        (*_llama8b(4096, 8), "--parallel.dp_replicate=2", "--parallel.dp_shard=4"),
        tiny=dict(world=4, ranks=(0,), overrides=(*TINY, "--parallel.dp_replicate=2", "--parallel.dp_shard=2")),
    ),
    Layout(
        "tp8",
        8,
        (0,),
        (*_llama8b(8192, 1), "--parallel.tp=8"),
        tiny=dict(world=2, ranks=(1,), overrides=(*TINY, "--parallel.tp=2")),
    ),
    *[
        Layout(
            f"cp8-{method}",
            8,
            (0,),
            (*_llama8b(32768, 1), "--parallel.cp=8", f"--parallel.cp_method={method}"),
            max_positions=32768,
            tiny=dict(world=2, ranks=(1,), overrides=(*TINY, "--parallel.cp=2", f"--parallel.cp_method={method}")),
        )
        for method in ("ring", "allgather", "ulysses")
    ],
    *[
        Layout(
            f"pp8-{schedule}",
            8,
            (0, 4, 7),  # first, a middle and the last stage
            (*_llama8b(1024, 8), "--parallel.pp=8", f"--parallel.pp_schedule={schedule}"),
            tiny=dict(
                world=4,
                ranks=(0, 2, 3),
                overrides=(*TINY_DEEP, "--parallel.pp=4", f"--parallel.pp_schedule={schedule}"),
            ),
        )
        for schedule in PP_SCHEDULES
    ],
    Layout(
        "llama70b-tp8xpp8",
        64,
        (0, 56),  # first and last stage
        (
            "--model.preset=llama-70b",
            "--data.seq_len=4096",
            "--train.global_batch_size=8",
            "--parallel.tp=8",
            "--parallel.pp=8",
        ),
        tiny=dict(world=4, ranks=(0, 2), overrides=(*TINY_DEEP, "--parallel.tp=2", "--parallel.pp=2")),
    ),
    Layout(
        "dpo-pp2xfsdp4",
        8,
        (0, 7),  # first and last stage: the reference runs as a forward-only pipeline
        (*_llama8b(4096, 8), "--parallel.pp=2", "--parallel.dp_shard=4"),
        pairs=True,
        tiny=dict(world=4, ranks=(0, 3), overrides=(*TINY_DEEP, "--parallel.pp=2", "--parallel.dp_shard=2")),
    ),
    Layout(
        "distill-pp2xfsdp2xtp2",
        8,
        (0, 7),  # first and last stage: the teacher runs as a forward-only pipeline of its own split
        (
            *_LLAMA1B_FROM_8B,
            "--data.seq_len=4096",
            "--train.global_batch_size=8",
            "--parallel.pp=2",
            "--parallel.dp_shard=2",
            "--parallel.tp=2",
        ),
        tiny=dict(
            world=8,
            ranks=(0, 7),
            overrides=(*TINY_FROM_SMALL, "--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2"),
        ),
    ),
    Layout(
        "ep8-qwen3moe",
        32,
        (0,),
        (*QWEN3MOE, "--parallel.dp_shard=32", "--parallel.ep=8"),
        routing=EP_ROUTING,
        tiny=dict(world=2, ranks=(0,), overrides=(*TINY_QWEN3MOE, "--parallel.dp_shard=2", "--parallel.ep=2")),
    ),
    Layout(
        "ep8-deepseekv3-small",
        8,
        (0,),
        (*DEEPSEEK, "--parallel.dp_shard=8", "--parallel.ep=8"),
        routing=EP_ROUTING,
        tiny=dict(world=2, ranks=(0,), overrides=(*TINY_DEEPSEEK, "--parallel.dp_shard=2", "--parallel.ep=2")),
    ),
    Layout(
        "ep8xtp2-qwen3moe",
        64,
        (0,),
        (*QWEN3MOE, "--parallel.dp_shard=32", "--parallel.tp=2", "--parallel.ep=8"),
        routing=EP_ROUTING,
        tiny=dict(
            world=4,
            ranks=(0,),
            overrides=(*TINY_QWEN3MOE, "--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.ep=2"),
        ),
    ),
]


# ------------------------------------------------------------------------------------------- worst-case routing


def _force_worst_case_routing() -> None:
    """Every rank routes every token to this rank's experts: the experts' forward gets its routing remapped onto
    this EP rank's experts, and the count exchange (the one integer all-to-all) tells this rank that every one of
    the ep ranks sends it what it sends itself. In this (forked) process only."""
    import meshtron.distributed.expert_parallel as expert_parallel
    import meshtron.distributed.one_rank_group as one_rank

    forward = expert_parallel.expert_parallel_forward

    def routed_here(self, hidden, top_k_index, top_k_weights):
        local = self.num_global_experts // self.ep_mesh.size()
        here = self.ep_mesh.get_local_rank() * local
        return forward(self, hidden, top_k_index % local + here, top_k_weights)

    fill = one_rank.ONE_RANK_KERNELS["alltoall_base_"]

    def every_rank_sends_here(out, inp, *rest):
        rank, size = one_rank._group(rest)
        if inp.dtype.is_floating_point or inp.numel() % size or out.numel() != inp.numel():
            return fill(out, inp, *rest)
        local = inp.numel() // size
        out.view(size, local).copy_(inp.view(size, local)[rank].expand(size, local))
        return one_rank._work()

    expert_parallel.expert_parallel_forward = routed_here
    one_rank.ONE_RANK_KERNELS["alltoall_base_"] = every_rank_sends_here


# ------------------------------------------------------------------------------------------------- running


def _rehearse_one(job: dict, connection) -> None:
    """In a forked process: rehearse ``job`` and send back its report (or its error)."""
    started = time.perf_counter()
    log = open(job["log"], "w")  # the training's own lines go to the job's log, not between the table's rows
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        from meshtron.config import load_config
        from meshtron.plan.rehearsal import rehearse

        if job["routing"] == "worst":
            _force_worst_case_routing()
        if job.get("max_positions"):
            _raise_max_positions(job["overrides"], job["max_positions"])
        cfg = load_config(None, job["overrides"], env={})
        report = rehearse(cfg, job["world"], job["rank"], steps=job["steps"]).to_json()
        connection.send({"report": report, "seconds": time.perf_counter() - started})
    except BaseException as error:  # noqa: BLE001 - an OOM or a refusal is this row's result
        lines = str(error).strip().splitlines() or traceback.format_exc().strip().splitlines()[-1:]
        message = f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
        connection.send({"error": message, "seconds": time.perf_counter() - started})
    finally:
        connection.close()


def _raise_max_positions(overrides: list[str], positions: int) -> None:
    """In the rehearsal's fork only: the preset named in ``overrides`` allows ``positions`` positions."""
    from meshtron.models.presets import PRESETS

    (preset,) = [item.split("=", 1)[1] for item in overrides if item.startswith("--model.preset=")]
    PRESETS[preset] = {**PRESETS[preset], "max_position_embeddings": positions}


def run_job(job: dict, timeout: float) -> dict:
    """Rehearse ``job`` in a fork; its report, or ``error`` when it fails, crashes or outlasts ``timeout``."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_rehearse_one, args=(job, send), daemon=True)
    started = time.perf_counter()
    process.start()
    send.close()
    result = None
    if receive.poll(timeout):
        try:
            result = receive.recv()
        except EOFError:
            result = None
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        why = f"no result after {timeout:.0f} s" if process.exitcode is None or process.exitcode < 0 else ""
        result = {"error": why or f"process exited with code {process.exitcode}"}
        result["seconds"] = time.perf_counter() - started
    return result


def _diff(measured, planned) -> float | None:
    if measured is None or not planned:
        return None
    return (measured - planned) / planned


def summarize(job: dict, result: dict) -> dict:
    """One row: the job, what was measured and planned, the relative differences and the flags."""
    row = {key: job[key] for key in ("layout", "rank", "world", "routing", "log")}
    row["seconds"] = round(result.get("seconds", 0.0), 1)
    if "error" in result:
        row["error"] = result["error"]
        return row
    report = result["report"]
    measured, planned = report["measured"], report["planned"]
    on_gpu = report["device"].startswith("cuda")
    compared = ["state_bytes", "activation_bytes"] + (["peak_bytes"] if on_gpu else [])
    compared += [key for key in ("reference_bytes", "teacher_bytes") if planned.get(key)]
    diffs = {key: _diff(measured[key], planned[key]) for key in compared}
    diffs["step_s"] = _diff(measured["step_s"], planned.get("compute_s"))
    flags = []
    if any(d is not None and abs(d) > MEMORY_TOLERANCE for key, d in diffs.items() if key != "step_s"):
        flags.append("MEM!")
    if diffs["step_s"] is not None and abs(diffs["step_s"]) > TIME_TOLERANCE:
        flags.append("TIME!")
    row.update(
        device=report["device"],
        parallel=report["layout"],
        measured=measured,
        planned=planned,
        diffs=diffs,
        flags=flags,
        notes=report["notes"],
    )
    return row


def _memory(row: dict, side: str) -> float | None:
    """The memory a stage's skew compares: peak on a GPU, else state + activations."""
    figures = row[side]
    if row["device"].startswith("cuda"):
        return figures["peak_bytes"]
    return figures["state_bytes"] + figures["activation_bytes"]


def pipeline_skew(rows: list[dict]) -> dict | None:
    """(max - min) / max of the stages' memory, measured and planned, over the rehearsed stages of one layout."""
    done = [row for row in rows if "error" not in row]
    if len(done) < 2:
        return None
    skew = {}
    for side in ("measured", "planned"):
        values = [_memory(row, side) for row in done]
        skew[side] = (max(values) - min(values)) / max(values) if max(values) else None
    return skew


UNIT = {"GB": 1e9}


def _gb(value) -> str:
    return f"{value / UNIT['GB']:7.2f}" if value is not None else "      -"


def _pct(value) -> str:
    return f"{value:+6.0%}" if value is not None else "     -"


def header(unit: str) -> str:
    return (
        f"{'layout':24} {'rank':>4} {'routing':8} | {f'state {unit} meas/plan':>22} | "
        f"{f'activ. {unit} meas/plan':>22} | {f'peak {unit} meas/plan':>22} | "
        f"{'step s meas/plan':>24} | flags  {'s':>5}"
    )


def format_row(row: dict) -> str:
    head = f"{row['layout']:24} {row['rank']:>4} {row['routing']:8}"
    if "error" in row:
        return f"{head} | ERROR after {row['seconds']:.0f} s: {row['error']} (log: {row['log']})"
    m, p, d = row["measured"], row["planned"], row["diffs"]
    cells = []
    for key in ("state_bytes", "activation_bytes", "peak_bytes"):
        cells.append(f"{_gb(m[key])} {_gb(p[key])} {_pct(d.get(key))}")
    compute = p.get("compute_s")
    step = f"{m['step_s']:8.3f} {compute:8.3f}" if compute is not None else f"{m['step_s']:8.3f} {'-':>8}"
    cells.append(f"{step} {_pct(d['step_s'])}")
    return f"{head} | " + " | ".join(cells) + f" | {' '.join(row['flags']) or 'ok':6} {row['seconds']:5.0f}"


def jobs_of(
    layout: Layout, tiny: bool, steps: int, output_root: Path, cache_dir: str | None, compile_blocks: bool = False
) -> list[dict]:
    world = layout.tiny["world"] if tiny else layout.world
    ranks = layout.tiny["ranks"] if tiny else layout.ranks
    overrides = list(layout.tiny["overrides"] if tiny else layout.overrides)
    if tiny:
        overrides += ["--run.device=cpu", "--data.max_documents=40"]
    if not compile_blocks:  # eager: a compile per layout would take most of the run's minutes
        overrides.append("--train.compile=false")
    if cache_dir:
        overrides.append(f"--data.cache_dir={cache_dir}")
    if layout.pairs:
        from meshtron.check.layouts import DPO_OVERRIDES, write_pairs

        pairs = write_pairs(output_root / "pairs.jsonl")
        overrides += [f"--{setting}" for setting in DPO_OVERRIDES] + [f"--data.path={pairs}"]
    return [
        {
            "layout": layout.name,
            "world": world,
            "rank": rank,
            "routing": routing,
            "steps": steps,
            "max_positions": None if tiny else layout.max_positions,
            "overrides": overrides + [f"--run.output_dir={output_root / f'{layout.name}-{rank}-{routing}'}"],
            "log": str(output_root / f"{layout.name}-{rank}-{routing}.log"),
        }
        for routing in layout.routing
        for rank in ranks
    ]


def select(only: str | None) -> list[Layout]:
    if not only:
        return LAYOUTS
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = {layout.name: layout for layout in LAYOUTS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"--only: unknown layout(s) {', '.join(unknown)}; see --list")
    return [known[name] for name in names]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated layout names (see --list); default: all")
    parser.add_argument("--steps", type=int, default=2, help="steps per rehearsal (>= 2: one warms up); default 2")
    parser.add_argument("--tiny", action="store_true", help="tiny models and degrees on the CPU (a smoke test)")
    parser.add_argument("--json", type=Path, help="write every row, the pipeline skews and the settings here")
    parser.add_argument(
        "--compile", action="store_true", help="train.compile as the config says (default: eager, no compile time)"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds one rehearsal may take; default 300")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where the rehearsals write (rehearsal.json, a log each); default: a new temp folder",
    )
    parser.add_argument("--cache-dir", help="data.cache_dir for the rehearsals (tokenized data)")
    parser.add_argument("--list", action="store_true", help="print the layouts and exit")
    args = parser.parse_args(argv)
    if args.list:
        for layout in LAYOUTS:
            print(f"{layout.name:24} world {layout.world:3} ranks {list(layout.ranks)} {' '.join(layout.overrides)}")
        return {}

    import meshtron.train.trainer  # noqa: F401  (imported once, before the forks: most of a rehearsal's start)
    from meshtron.command import meshtron_command

    layouts = select(args.only)
    output_root = args.output_dir or Path(tempfile.mkdtemp(prefix="rehearse-layouts-"))
    output_root.mkdir(parents=True, exist_ok=True)
    jobs = [
        job
        for layout in layouts
        for job in jobs_of(layout, args.tiny, args.steps, output_root, args.cache_dir, args.compile)
    ]
    shapes = "tiny, CPU" if args.tiny else "real shapes"
    print(
        f"{len(jobs)} rehearsals of {len(layouts)} layouts, {args.steps} steps each ({shapes}); logs in {output_root}"
    )
    print(
        f"memory flagged (MEM!) beyond {MEMORY_TOLERANCE:.0%} of the plan, the step without communication (TIME!) "
        f"beyond {TIME_TOLERANCE:.0%} of the planner's compute time"
    )
    unit = "MB" if args.tiny else "GB"
    UNIT["GB"] = 1e6 if args.tiny else 1e9
    print(header(unit))
    started = time.perf_counter()
    rows = []
    for job in jobs:
        row = summarize(job, run_job(job, args.timeout))
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json:  # row by row, so that a run cut short keeps what it measured
            _write_json(args.json, {"rows": rows, "complete": False})
    skews = {}
    for layout in layouts:
        if "--parallel.pp" in " ".join(layout.tiny["overrides"] if args.tiny else layout.overrides):
            skew = pipeline_skew([row for row in rows if row["layout"] == layout.name])
            if skew:
                skews[layout.name] = skew
    if skews:
        print("pipeline: skew of memory across the rehearsed stages, (max - min) / max (GPU: peak; CPU: state + act.)")
        for name, skew in skews.items():
            print(f"  {name:24} measured {_pct(skew['measured'])}  planned {_pct(skew['planned'])}")
    worst = [row for row in rows if row["routing"] == "worst" and "error" not in row]
    for row in worst:
        balanced = next(
            (
                r
                for r in rows
                if r["layout"] == row["layout"] and r["rank"] == row["rank"] and r["routing"] == "balanced"
            ),
            None,
        )
        if balanced and "error" not in balanced:
            key = "peak_bytes" if row["device"].startswith("cuda") else "activation_bytes"
            ratio = row["measured"][key] / balanced["measured"][key] if balanced["measured"][key] else float("nan")
            step = row["measured"]["step_s"] / balanced["measured"]["step_s"]
            print(f"  {row['layout']}: worst-case routing {key} x{ratio:.2f}, step x{step:.2f} of balanced")
    failed = sum("error" in row for row in rows)
    flagged = sum(bool(row.get("flags")) for row in rows)
    print(f"{len(rows)} rehearsals in {time.perf_counter() - started:.0f} s: {failed} failed, {flagged} flagged")
    result = {
        "command": f"{sys.executable} bench/rehearse_layouts.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "meshtron": meshtron_command(),
        "steps": args.steps,
        "tiny": args.tiny,
        "compile": args.compile,
        "memory_tolerance": MEMORY_TOLERANCE,
        "time_tolerance": TIME_TOLERANCE,
        "rows": rows,
        "pipeline_skew": skews,
    }
    if args.json:
        _write_json(args.json, {**result, "complete": True})
        print(f"wrote {args.json}")
    return result


def _write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1) + "\n")


if __name__ == "__main__":
    main()
