"""One-GPU checks of training paths: short runs and rehearsals on the GPU against the CPU, float64 or the planner
(``gpu_queue.py`` runs them, each in its own process). Thresholds are stated in each check; a figure that matters is
returned whether it passes or not (the failure message carries it)."""

from __future__ import annotations

import math
import re

from gpu_support import (
    ON_CPU,
    Skip,
    cuda_device,
    device_setting,
    exact_float32,
    expect_close,
    expect_ratio,
    meshtron,
    metrics_rows,
    pinned_stats,
    record,
    rehearse_here,
    settings_for,
    train_here,
)

FP32 = ("precision.mixed_precision=none", "train.compile=false")
"""What comparisons with the CPU train in: fp32, eager (on CUDA meshtron's default is bf16 and compiled)."""
# a llama whose activations outweigh the allocator's workspaces at a short length (256 wide, 4 blocks)
MID = dict(preset="llama-mini", seq_len=2048, batch=2, steps=4)


def _losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows]


def _cpu_against_gpu(out, *extra: str) -> dict:
    """llama-tiny trained 3 steps in fp32 on the CPU and on the GPU (TF32 off) with ``extra``; the results."""
    import torch

    device = cuda_device()
    exact_float32(torch)
    cpu = train_here("cpu", settings_for(out / "cpu", *FP32, *extra))
    gpu = train_here(device, settings_for(out / "gpu", *FP32, *extra))
    return {"cpu": cpu, "gpu": gpu}


def muon(out) -> dict:
    """``optimizer.name=muon`` on the GPU against the CPU: losses and gradient norms over 3 steps."""
    runs = _cpu_against_gpu(out, "optimizer.name=muon")
    worst = expect_close("losses", runs["gpu"].losses, runs["cpu"].losses, 1e-3)
    return {"loss_rel_diff": worst, "losses": [round(x, 5) for x in runs["gpu"].losses]}


def lora(out) -> dict:
    """``[lora]`` (rank 4 adapters, the base frozen) on the GPU against the CPU: losses over 3 steps."""
    runs = _cpu_against_gpu(out, "lora.rank=4", "lora.alpha=8")
    worst = expect_close("losses", runs["gpu"].losses, runs["cpu"].losses, 1e-4)
    return {"loss_rel_diff": worst}


def _preference_pairs(path) -> str:
    """40 pairs whose chosen answer is the prompt's word in capitals (tests/preference_fixture.py's ``upper``)."""
    import json

    words = "cat dog sun map red cup hat pen box sky fig owl bee ant elk".split()
    lines = [
        json.dumps({"prompt": f"shout: {w}", "chosen": " " + w.upper(), "rejected": " " + w})
        for w in (words[(7 * i) % len(words)] for i in range(40))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def preference_dpo(out) -> dict:
    """``train.objective=dpo`` on the GPU against the CPU (fp32, a live reference copy; then LoRA's base as the
    reference): losses and rewards over 3 steps; then bf16 with compiled blocks on the GPU: it learns."""
    import torch

    data = _preference_pairs(out / "pairs.jsonl")
    dpo = ["train.objective=dpo", "dpo.beta=0.5", "data.format=preference", f"data.path={data}", "data.seq_len=32",
           "optimizer.lr=3e-3"]  # fmt: skip
    runs = _cpu_against_gpu(out / "model", *dpo)
    worst = expect_close("losses", runs["gpu"].losses, runs["cpu"].losses, 1e-4)
    lora = _cpu_against_gpu(out / "lora", *dpo, "lora.rank=4", "lora.alpha=8")
    worst_lora = expect_close("LoRA-base losses", lora["gpu"].losses, lora["cpu"].losses, 1e-4)
    fast = train_here(
        cuda_device(),
        settings_for(out / "bf16", *dpo, "precision.mixed_precision=bf16", "train.compile=true", steps=6),
    )
    assert all(map(torch.isfinite, map(torch.tensor, fast.losses))), fast.losses
    assert fast.losses[-1] < fast.losses[0], f"bf16 compiled DPO did not learn: {fast.losses}"
    return {
        "loss_rel_diff": worst,
        "lora_base_loss_rel_diff": worst_lora,
        "bf16_compiled_losses": [round(x, 4) for x in fast.losses],
    }


DISTILL = ("train.objective=distill", "distill.teacher=llama-small", "distill.divergence=jsd", "distill.alpha=0.5",
           "distill.temperature=2.0", "optimizer.lr=3e-3", "schedule.warmup_steps=1")  # fmt: skip
"""llama-tiny distilled from llama-small (random weights): the fused loss's widest path (the jsd mixture, a
temperature, the cross-entropy beside the divergence)."""


def distill(out) -> dict:
    """``train.objective=distill`` on the GPU against the CPU (fp32, 3 steps): losses, cross-entropies and
    divergences; the teacher's bytes on the GPU as planned (fp32, then bf16); then bf16 with compiled blocks and a
    bf16 teacher on the GPU: the fused loss (chunks of 16 tokens) equals the unfused one within 2e-2, and it learns."""
    import torch

    runs = _cpu_against_gpu(out / "fp32", *DISTILL)
    figures = {"loss_rel_diff": expect_close("losses", runs["gpu"].losses, runs["cpu"].losses, 1e-5)}
    rows = {side: metrics_rows(out / "fp32" / side) for side in ("cpu", "gpu")}
    for key in ("nll_loss", "divergence"):
        got, want = ([row[key] for row in rows[side]] for side in ("gpu", "cpu"))
        figures[f"{key}_rel_diff"] = expect_close(key, got, want, 1e-5)
    bf16 = {name: _distill_bf16(out / name, chunk) for name, chunk in (("fused", 16), ("unfused", 0))}
    teacher = {"fp32": (runs["gpu"].teacher_bytes, _planned_teacher(settings_for(out, *FP32, *DISTILL))),
               "bf16": (bf16["fused"].teacher_bytes, _planned_teacher(_bf16_distill_settings(out, 16)))}  # fmt: skip
    figures["teacher_bytes_fp32_bf16"] = [measured for measured, _ in teacher.values()]
    record(**figures)
    for dtype, (measured, planned) in teacher.items():
        assert measured == planned > 0, f"{dtype} teacher: {measured:,} bytes on the GPU, {planned:,} planned"
    losses = bf16["fused"].losses
    figures["bf16_compiled_losses"] = [round(x, 4) for x in losses]
    record(**figures)
    assert all(map(torch.isfinite, map(torch.tensor, losses))), losses
    figures["fused_vs_unfused_rel_diff"] = expect_close("fused vs unfused", losses, bf16["unfused"].losses, 2e-2)
    assert losses[-1] < losses[0], f"bf16 compiled distillation did not learn: {losses}"
    return figures


def _bf16_distill_settings(out, chunk: int) -> list[str]:
    """The bf16, compiled distillation run with ``train.loss_chunk_size=chunk`` (0: unfused), a bf16 teacher."""
    return settings_for(out, *DISTILL, "distill.teacher_dtype=bfloat16", "precision.mixed_precision=bf16",
                        "train.compile=true", f"train.loss_chunk_size={chunk}", device_setting(), steps=6)  # fmt: skip


def _distill_bf16(out, chunk: int):
    return train_here(cuda_device(), _bf16_distill_settings(out, chunk))


def _planned_teacher(settings: list[str]) -> int:
    """The planner's teacher bytes for one rank of ``settings``."""
    from meshtron.config import load_config
    from meshtron.plan.memory import planned_teacher_bytes

    return planned_teacher_bytes(load_config(None, settings, env={}), 1, 0)


def validation(out) -> dict:
    """``[eval]`` on held-out documents every 2 steps on the GPU against the CPU: the evaluation losses."""
    runs = _cpu_against_gpu(out, "eval.holdout_documents=4", "eval.interval=2", "eval.batches=2")
    got, want = ([loss for _, loss in runs[side].eval_losses] for side in ("gpu", "cpu"))
    assert got, "no evaluation ran"
    worst = expect_close("eval losses", got, want, 1e-4)
    return {"eval_loss_rel_diff": worst, "eval_losses": [round(x, 5) for x in got]}


def prefetch_pinning(out) -> dict:
    """``data.prefetch`` on the GPU: the read-ahead batches are pinned (the pinned allocator hands out blocks) and
    the losses equal those without prefetch."""
    import torch

    device = cuda_device()
    plain = train_here(device, settings_for(out / "plain", *FP32, "data.prefetch=false"))
    before = pinned_stats()
    ahead = train_here(device, settings_for(out / "ahead", *FP32, "data.prefetch=true"))
    after = pinned_stats()
    if not after:
        raise Skip(f"torch {torch.__version__} has no torch.cuda.host_memory_stats to see pinning")
    handed_out = after.get("active_requests.allocated", 0) - before.get("active_requests.allocated", 0)
    assert handed_out > 0, "prefetch pinned nothing (no pinned block handed out during the run)"
    assert ahead.losses == plain.losses, f"prefetch changed the losses: {ahead.losses} vs {plain.losses}"
    return {"pinned_blocks_handed_out": handed_out}


def cpu_offload_one_gpu(out) -> dict:
    """``fsdp.cpu_offload`` on one GPU (``--nproc 1``: FSDP over one rank, state and the step on the host) against
    the same run on the CPU without it: losses over 3 steps; the GPU's peak memory."""
    import torch

    cuda_device()
    exact_float32(torch)
    cpu = train_here("cpu", settings_for(out / "cpu", *FP32))
    gpu_settings = settings_for(out / "gpu", *FP32, "fsdp.cpu_offload=true", device_setting())
    meshtron("train", "--nproc", "1", *(f"--{s}" for s in gpu_settings))
    rows = metrics_rows(out / "gpu")
    worst = expect_close("losses", _losses(rows), cpu.losses, 1e-4)
    return {"loss_rel_diff": worst, "gpu_peak_gib": round(max(r["max_memory_gb"] for r in rows), 4)}


def forked_nproc1_torchao(out) -> dict:
    """Issue 56, finding 1: ``meshtron train --nproc 1`` on CUDA with torchao importable (its import queries the
    device): the forked rank trains (no "Cannot re-initialize CUDA in forked subprocess")."""
    from gpu_kernels import require

    cuda_device()
    require("torchao")
    settings = settings_for(out / "run", "train.compile=false", device_setting())
    text = meshtron("train", "--nproc", "1", *(f"--{s}" for s in settings))
    assert "re-initialize CUDA" not in text, "a forked rank met CUDA initialized in the forkserver"
    assert "starting each worker fresh" not in text, "the forkserver initialized CUDA: the ranks started fresh"
    losses = _losses(metrics_rows(out / "run"))
    assert len(losses) == 3 and all(map(math.isfinite, losses)), f"losses {losses}"
    return {"losses": [round(x, 4) for x in losses], "nvml_capability": nvml_capability_matches_cuda()}


def nvml_capability_matches_cuda() -> str:
    """The forkserver's answer to torchao's capability query (NVML) against CUDA's own, in a fresh process."""
    import subprocess
    import sys

    code = (
        "import torch; from meshtron.train.setup.rank_imports import capability_from_nvml as nvml; "
        "a = nvml(0); assert not torch.cuda.is_initialized(); b = torch.cuda.get_device_capability(0); "
        "assert a == b, (a, b); print(a)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"NVML's capability against CUDA's: {done.stderr.strip().splitlines()[-1:]}"
    return done.stdout.strip()


def meshtron_check_nproc1(out) -> dict:
    """``meshtron check --nproc 1``: the GPU's one-process run against the CPU's."""
    cuda_device()
    text = meshtron("check", "--nproc", "1")
    rows = [line for line in text.splitlines() if "1gpu_vs_cpu" in line]
    assert rows and "pass" in rows[-1], f"no passing 1gpu_vs_cpu row in: {text.strip().splitlines()[-4:]}"
    return {"row": rows[-1].strip()}


def _rehearsed(out, name: str, *extra: str, world: int = 1, rank: int = 0, **shape):
    """A rehearsal (``meshtron train --rehearse``) on the GPU of llama-mini at 2,048 tokens with ``extra``."""
    cuda_device()
    shape = {**MID, **shape}
    # eager unless ``extra`` says otherwise: compiling each rehearsal would cost most of the queue's time
    settings = settings_for(
        out / name, device_setting(), "data.max_documents=200", "train.compile=false", *extra, **shape
    )
    return rehearse_here(settings, world, rank, steps=shape["steps"])


def activation_offload(out) -> dict:
    """``train.activation_offload``: bytes kept on the device (none) and in host memory against the plan, the
    losses unchanged, one step's time with and without; issue 56 finding 3: the pinned bytes the host allocator
    holds (rounded up to powers of two by torch) against the planner's host figure."""
    plain, plain_losses = _rehearsed(out, "plain")
    stats_before = pinned_stats()
    offload, offload_losses = _rehearsed(out, "offload", "train.activation_offload=true")
    stats = pinned_stats()
    measured, planned = offload.measured, offload.planned
    figures = record(step_s_plain=round(plain.measured["step_s"], 4), step_s_offload=round(measured["step_s"], 4))
    figures["kept_on_device_bytes"] = measured["activation_bytes"]
    figures["host_measured_over_planned"] = expect_ratio(
        "host bytes", measured["host_activation_bytes"], planned["host_activation_bytes"], 0.75, 1.33
    )
    figures["peak_measured_over_planned"] = round(measured["peak_bytes"] / planned["peak_bytes"], 4)
    expect_close("losses with offloading", offload_losses, plain_losses, 1e-3)
    assert measured["activation_bytes"] <= 0.1 * plain.measured["activation_bytes"], (
        f"{measured['activation_bytes']:,} B kept on the device with offloading "
        f"({plain.measured['activation_bytes']:,} without)"
    )
    if stats:
        pinned = stats.get("allocated_bytes.peak", 0) - stats_before.get("allocated_bytes.current", 0)
        figures["pinned_peak_bytes"] = pinned
        figures["pinned_over_planned_host"] = expect_ratio(
            "pinned bytes (finding 3)", pinned, planned["host_activation_bytes"], 0.5, 1.1
        )
    return figures


def tiled_mlp(out) -> dict:
    """``train.mlp_tiles=4``: the same losses as untiled and fewer bytes kept for backward, as planned; with
    offloading too (issue 56 finding 2), the pinned bytes handed out per step near the planned host bytes (the
    tiles' recomputation in backward copied nothing to the host and back)."""
    plain, plain_losses = _rehearsed(out, "plain")
    tiled, tiled_losses = _rehearsed(out, "tiled", "train.mlp_tiles=4")
    figures = record(loss_rel_diff=expect_close("losses with tiles", tiled_losses, plain_losses, 1e-3))
    figures["kept_tiled_over_untiled"] = round(
        tiled.measured["activation_bytes"] / plain.measured["activation_bytes"], 4
    )
    assert figures["kept_tiled_over_untiled"] < 1, "tiles kept no fewer bytes for backward"
    figures["kept_measured_over_planned"] = expect_ratio(
        "kept bytes", tiled.measured["activation_bytes"], tiled.planned["activation_bytes"], 0.75, 1.33
    )
    before = pinned_stats()
    both, _ = _rehearsed(out, "tiled_offload", "train.mlp_tiles=4", "train.activation_offload=true")
    after = pinned_stats()
    if after:
        per_step = (after["active_bytes.allocated"] - before.get("active_bytes.allocated", 0)) / MID["steps"]
        # up to 2x from the allocator's power-of-two blocks; the defect's signature is one host round trip per tile
        figures["host_bytes_per_step_over_planned"] = expect_ratio(
            "pinned bytes handed out per step (finding 2)", per_step, both.planned["host_activation_bytes"], 0.5, 2.5
        )
    return figures


def tp_compiled_offload(out) -> dict:
    """Issue 56 finding 4: rank 0 of a compiled TP2 run with offloading (``--rehearse --nproc 2 --rank 0``): the
    host bytes are the activations planned, not the weights too."""
    report, _ = _rehearsed(
        out, "tp2", "parallel.tp=2", "train.compile=true", "train.activation_offload=true", world=2, rank=0
    )
    measured, planned = report.measured, report.planned
    return {
        "host_measured_over_planned": expect_ratio(
            "host bytes", measured["host_activation_bytes"], planned["host_activation_bytes"], 0.75, 1.25
        ),
        "state_bytes": measured["state_bytes"],
    }


def pp_zero_bubble_offload(out) -> dict:
    """Issue 56 finding 5: rank 0 of PP2 under ZBVZeroBubble with offloading, 4 microbatches: peak device memory near
    the plan (what is fetched ahead stays within the stage and micro-batch)."""
    report, _ = _rehearsed(
        out, "pp2", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "train.activation_offload=true",
        "train.micro_batch_size=1", world=2, rank=0, batch=4,
    )  # fmt: skip
    measured, planned = report.measured, report.planned
    return {
        "peak_measured_over_planned": expect_ratio(
            "peak bytes", measured["peak_bytes"], planned["peak_bytes"], 0.5, 1.15
        ),
        "host_measured_over_planned": round(measured["host_activation_bytes"] / planned["host_activation_bytes"], 4),
    }


def cp_hybrid_rehearsal(out) -> dict:
    """Rank 1 of hybrid CP4 (Ulysses pairs, a ring of two) with document masks on the GPU (``--rehearse``): the
    attention kernels on CUDA at their real shapes, finite, activations against the plan."""
    report, losses = _rehearsed(
        out, "hybrid", "parallel.cp=4", "parallel.cp_method=hybrid", "parallel.cp_ulysses=2", world=4, rank=1,
        seq_len=4096, batch=1,
    )  # fmt: skip
    assert all(map(math.isfinite, losses)), f"losses {losses}"
    measured, planned = report.measured, report.planned
    return {
        "activations_measured_over_planned": expect_ratio(
            "activation bytes", measured["activation_bytes"], planned["activation_bytes"], 0.6, 1.3
        ),
        "step_s": round(measured["step_s"], 4),
    }


def float8_rowwise(out) -> dict:
    """``precision.float8_recipe=rowwise`` (torchao) on the GPU: losses within 3% of bf16's over 4 steps."""
    import torch
    from gpu_kernels import require

    device = cuda_device()
    require("torchao")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise Skip("float8 matmuls need compute capability 8.9+")
    common = ("precision.mixed_precision=bf16", "train.compile=true", device_setting(), "data.max_documents=200")
    bf16 = train_here(device, settings_for(out / "bf16", *common, preset="llama-mini", seq_len=1024, steps=4))
    float8 = train_here(
        device,
        settings_for(
            out / "f8", *common, "precision.float8=true", "precision.float8_recipe=rowwise", preset="llama-mini",
            seq_len=1024, steps=4,
        ),
    )  # fmt: skip
    worst = expect_close("float8 rowwise losses vs bf16", float8.losses, bf16.losses, 3e-2)
    return {
        "loss_rel_diff": worst,
        "tokens_per_s_float8_over_bf16": round(float8.tokens_per_s[-1] / bf16.tokens_per_s[-1], 3),
    }


LLAMA_1B = "llama-tiny" if ON_CPU else "llama-1b"  # on the CPU only the check's logic can be tried
SUMMARY_TOTAL = re.compile(r"^\s+total\s+([0-9.]+) ms", re.M)


def compiled_llama1b(out) -> dict:
    """llama-1b compiled, bf16, seq 2048, global batch 4 in 2 micro-batches (the casts once per step), 7 steps, the
    last two profiled: metrics.jsonl's planned peak memory and step time beside the measured ones (within 15% and
    30%), and the live profiler's kernel summary within the profiled steps' wall time."""
    cuda_device()
    run = out / "llama1b"
    settings = settings_for(run, preset=LLAMA_1B, seq_len=2048, batch=4, steps=7) + [
        "data.max_documents=400",
        "model.dtype=float32",
        "precision.mixed_precision=bf16",
        f"train.compile={str(not ON_CPU).lower()}",
        "train.micro_batch_size=2",
        device_setting(),
        "run.profile_steps=6-7",
    ]
    text = meshtron("train", *(f"--{s}" for s in settings))
    rows = metrics_rows(run)
    totals = SUMMARY_TOTAL.findall(text)
    assert totals, "no profile summary printed"
    profiled_ms = 1000 * sum(r["step_s"] for r in rows if r["step"] in (6, 7))
    figures = record(profile_kernels_over_wall=round(float(totals[-1]) / profiled_ms, 3), mfu=rows[4].get("mfu"))
    planned = [row for row in rows if "planned_peak_gb" in row]
    assert planned, "no metrics row carries planned_peak_gb (the GPU's planned-vs-measured fields)"
    row = planned[0]
    record(peak_gib=round(row["max_memory_gb"], 3), planned_peak_gib=row["planned_peak_gb"])
    record(step_s=row["step_s"], planned_step_s=row.get("planned_step_s"))
    expect_ratio("peak memory", row["max_memory_gb"], row["planned_peak_gb"], 0.85, 1.15)
    assert row.get("planned_step_s"), "no planned_step_s: the planner does not model this GPU"
    expect_ratio("step time", row["step_s"], row["planned_step_s"], 0.7, 1.3)
    assert 0.3 <= figures["profile_kernels_over_wall"] <= 1.05, "the profile's kernel time is not within the steps"
    return figures


def nccl_start_up(out) -> dict:
    """Issue 43's one-GPU NCCL checks, kept as regressions: on a 1-rank NCCL group meshtron's start-up creates
    DTensor's RNG tracker without a broadcast (dropout on a DTensor broadcasts nothing); the hang watchdog counts a
    stream with queued work as waiting."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import _random as dtensor_random

    from meshtron.config import ParallelConfig
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.distributed.rng import seed_parallel_rng
    from meshtron.resilience.watchdog import device_stream_pending

    device = cuda_device()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        meshes = ParallelDims.from_config(ParallelConfig(), 1).build_mesh("cuda")
        broadcasts, broadcast = [], dist.broadcast
        dist.broadcast = lambda *a, **k: broadcasts.append(1) or broadcast(*a, **k)
        try:
            seed_parallel_rng(meshes, 0)
            x = distribute_tensor(torch.ones(4, 64, device=device), meshes.tp, [Replicate()])
            torch.nn.functional.dropout(x, 0.5)
        finally:
            dist.broadcast = broadcast
        assert dtensor_random._rng_tracker is not None and not broadcasts, f"{len(broadcasts)} broadcasts"
        pending = device_stream_pending(device)
        idle = pending()
        torch.cuda._sleep(1_000_000_000)
        busy = pending()
        torch.cuda.synchronize()
        assert busy and not idle, f"stream pending: idle {idle}, with a queued kernel {busy}"
    finally:
        dist.destroy_process_group()
    return {"broadcasts": 0}
