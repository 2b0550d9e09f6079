"""Profiling (docs/profiling.md): the trace file, the summary by category, and its accounting (GPU kernels from a
recorded H100 trace and synthetic ones, CPU operators from a run). The 2-process trace per rank is checked in
test_train.py's self-launch test."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshtron.config import load_config, parse_step_range
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError
from meshtron.metrics.profiling import (
    CATEGORIES,
    StepProfiler,
    category,
    kernel_category,
    load_trace,
    summarize_kernels,
    summarize_operators,
    summarize_profile,
)
from meshtron.train.trainer import train


@pytest.mark.parametrize(
    "name, expected",
    [
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("aten::_grouped_mm", "matmul"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("flash_fwd_kernel", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("c10d::allgather_", "communication"),
        ("Optimizer.step#AdamW.step", "optimizer"),
        ("aten::_foreach_mul_", "optimizer"),
        ("aten::_foreach_copy_", "copies"),  # the master gradients' widening, FSDP2's copy-in
        ("aten::copy_", "copies"),
        ("Memcpy HtoD (Pageable -> Device)", "copies"),
        ("aten::cat", "copies"),
        ("aten::silu", "other"),
        ("MmBackward0", "other"),  # the autograd node's own overhead; its aten::mm child is the matmul
    ],
)
def test_category_of_an_operator_or_kernel(name, expected):
    assert category(name) == expected


def event(name: str, own_us: float, parent=None):
    return SimpleNamespace(name=name, self_cpu_time_total=own_us, cpu_parent=parent, kernels=[])


def test_summary_counts_each_operator_once_in_its_outermost_enclosing_category():
    attention = event("aten::scaled_dot_product_attention", 5.0)
    step = event("Optimizer.step#AdamW.step", 1.0)
    events = [
        attention,
        event("aten::bmm", 20.0, attention),  # SDPA's own matmul on CPU: attention's time
        event("aten::mm", 30.0),
        step,
        event("aten::_foreach_add_", 4.0, step),
        event("aten::copy_", 2.0, event("c10d::allreduce_", 3.0)),  # a copy inside a collective
        event("aten::silu", 7.0),
    ]
    summary = summarize_operators(events)
    assert summary.times_us == {
        "matmul": 30.0,
        "attention": 25.0,
        "communication": 2.0,  # the allreduce itself is not in the list, only its copy
        "optimizer": 5.0,
        "copies": 0.0,
        "other": 7.0,
    }
    assert summary.total_us == 69.0


@pytest.mark.parametrize(
    "name, expected",
    [  # names as the recorded H100 trace spells them (shortened), and other libraries' kernels
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "matmul"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
        ("triton_tem_fused_mm_0", "matmul"),  # inductor's max-autotune template
        ("triton_tem_fused__unsafe_view_flex_attention_transpose_view_3", "attention"),
        ("triton_tem_fused_flex_attention_backward_transpose_view_3", "attention"),
        ("triton_per_fused_flex_attention_backward_transpose_view_2", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128", "attention"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>",
            "optimizer",
        ),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<float, c10::BFloat16, 2, 1, 1>>",
            "copies",
        ),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
        ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 8>", "communication"),
        ("void at::native::small_gather_kernel<float>", "other"),  # no all-gather
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
            "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>",
            "copies",
        ),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(...)>", "copies"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("Memset (Device)", "copies"),
        # inductor's fused kernels are named after the aten ops they fuse: a `_to_copy` inside is no copy kernel
        ("triton_poi_fused__to_copy_mul_ne_unsqueeze_3", "other"),
        ("triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_4", "other"),
        ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0", "other"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>", "other"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>", "other"),
    ],
)
def test_category_of_a_gpu_kernel(name, expected):
    assert kernel_category(name) == expected


FIXTURES = Path(__file__).resolve().parent / "fixtures"
H100_TRACE = FIXTURES / "h100-llama-1b-b8-steps5-7.trace.json.gz"
"""The Chrome trace that ``run.profile_steps=5-7`` wrote on one H100 80GB (torch 2.11.0+cu130, 2026-11-26): llama-1b,
seq 2048, batch 8, compiled, bf16, document masks, rank 0. Copied from ../shared/gpu-measurements/ (README.md
there holds the reference table used below: 793 ms of kernels over the 3 steps; per step matmul 156.8 ms = 59.3%,
attention 35.9 ms = 13.6%, optimizer 18.8 ms = 7.1%)."""


def test_the_summary_of_a_recorded_h100_trace_counts_its_kernels_once():
    """On the real trace the summary matches the kernels' own sum (the operators' device time had said 1,629 ms),
    and its matmul, attention and optimizer shares match the reference table computed from kernel names."""
    events = load_trace(H100_TRACE)
    summary = summarize_kernels(events, steps=3)
    assert summary.device == "cuda" and summary.steps == 3
    assert summary.total_us / 1e3 == pytest.approx(793.0, rel=0.01)
    assert summary.share("matmul") == pytest.approx(0.593, abs=0.005)
    assert summary.share("attention") == pytest.approx(0.136, abs=0.005)
    assert summary.share("optimizer") == pytest.approx(0.071, abs=0.005)
    assert summary.times_us["communication"] == 0  # one GPU
    assert sum(summary.share(name) for name in CATEGORIES) == pytest.approx(1.0)
    assert 0.9 <= summary.busy_share <= 1.0
    # Everything GPU-side is counted, nothing else: the categories add up to the GPU events' own sum.
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    assert summary.total_us == pytest.approx(sum(e["dur"] for e in gpu))
    table = summary.table("profile of steps 5-7 on rank 0")
    rows = {
        name: (float(total), float(step))
        for name, total, step in re.findall(r"^  (\w+)\s+([\d.]+) ms\s+([\d.]+) ms/step", table, re.MULTILINE)
    }
    assert set(rows) == {*CATEGORIES, "total"}, table
    assert rows["matmul"][1] == pytest.approx(156.8, abs=0.1)  # the reference table's ms per step
    assert rows["total"][1] == pytest.approx(rows["total"][0] / 3, abs=1e-3)
    assert "GPU time of kernels, memcpy and memset, 3 steps" in table and "the GPU was busy" in table


def complete(cat: str, name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": {}}


SYNTHETIC = [
    complete("cpu_op", "aten::mm", 0.0, 4.0),  # launches; its own time is no GPU time
    complete("cuda_runtime", "cudaLaunchKernel", 1.0, 2.0),
    complete("kernel", "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NTT", 10.0, 10.0, stream=7),
    complete("kernel", "flash_fwd_kernel", 15.0, 10.0, stream=8),  # overlaps the matmul on another stream
    complete("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 40.0, 2.0),
    complete("gpu_memset", "Memset (Device)", 41.0, 1.0),  # inside the memcpy's interval
    complete("gpu_user_annotation", "Optimizer.step#AdamW.step", 10.0, 50.0),  # an annotation, not work
    complete("Trace", "PyTorch Profiler (0)", -100.0, 400.0),  # the profiler's own span, not the steps
    {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 0, "tid": 7, "ts": 1.0, "id": 1},
    complete("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 45.0, 5.0, stream=9),
]


def test_a_synthetic_trace_counts_gpu_work_once_and_busy_time_as_the_union():
    summary = summarize_kernels(SYNTHETIC, steps=2)
    assert summary.times_us == {
        "matmul": 10.0,
        "attention": 10.0,
        "communication": 5.0,
        "optimizer": 0.0,
        "copies": 3.0,  # memcpy and memset events, whatever their name
        "other": 0.0,
    }
    assert summary.busy_us == 15.0 + 2.0 + 5.0  # [10, 25) on two streams, [40, 42), [45, 50)
    assert summary.wall_us == 50.0  # the first operator's start to the last kernel's end
    assert summary.busy_share == pytest.approx(22.0 / 50.0)
    # A trace without GPU work has no busy share (a CPU run's trace).
    cpu_only = summarize_kernels([SYNTHETIC[0], SYNTHETIC[1]])
    assert cpu_only.total_us == 0 and cpu_only.busy_share is None


def test_a_cuda_profile_is_summarized_from_its_trace_and_falls_back_to_operators(tmp_path, monkeypatch):
    """StepProfiler's CUDA path (not yet run on a GPU) on CPU: a stand-in profiler writes the synthetic trace; the
    logged table is the kernels', per step; a CUDA trace without GPU events gives the operators' table instead."""
    written = {"events": SYNTHETIC}

    class Recorded:
        def stop(self):
            pass

        def export_chrome_trace(self, path):
            Path(path).write_text(json.dumps({"traceEvents": written["events"]}))

        def events(self):
            return [event("aten::mm", 30.0)]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    run = load_config(None, ["train.steps=4", "run.profile_steps=2-3"], env={}).run
    profiler = StepProfiler(run, tmp_path, rank=0, device=torch.device("cuda"))
    profiler._profiler = Recorded()
    messages = []
    profiler.after_step(3, messages.append)
    assert profiler.summary.device == "cuda" and profiler.summary.busy_us == 22.0
    assert re.search(r"^  matmul\s+0\.010 ms\s+0\.005 ms/step\s+35\.7%$", messages[0], re.MULTILINE), messages[0]
    assert "GPU time of kernels, memcpy and memset, 2 steps" in messages[0]
    assert (tmp_path / "profile" / "rank-0.json").is_file()

    written["events"] = SYNTHETIC[:2]  # operators and runtime calls only
    Recorded().export_chrome_trace(tmp_path / "cpu.json")
    fallback = summarize_profile(Recorded(), tmp_path / "cpu.json", "cuda", steps=2)
    assert fallback.device == "cpu" and fallback.times_us["matmul"] == 30.0
    assert "CPU time of operators" in fallback.table("profile of steps 2-3 on rank 0")


@pytest.mark.parametrize("value", ["0-2", "3-2", "a-b", "2-", "1,2"])
def test_a_bad_step_range_is_a_one_line_error(value):
    with pytest.raises(ConfigError, match=f"run.profile_steps: '{value}' is not a range of steps"):
        parse_step_range("run.profile_steps", value)
    assert parse_step_range("run.profile_steps", "4") == (4, 4) and parse_step_range("x", " 2 - 5 ") == (2, 5)
    with pytest.raises(ConfigError, match="goes past the last step"):
        load_config(None, ["train.steps=4", "run.memory_snapshot_steps=3-5"], env={})


def top_level_microseconds(trace: dict) -> float:
    """The summed duration of the trace's outermost operators (those inside no other one on their thread)."""
    by_thread = collections.defaultdict(list)
    for item in trace["traceEvents"]:
        if item.get("ph") == "X" and item.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(item["pid"], item["tid"])].append(item)
    total = 0.0
    for items in by_thread.values():
        end = -1.0
        for item in sorted(items, key=lambda i: (i["ts"], -i["dur"])):
            if item["ts"] >= end:
                total += item["dur"]
                end = item["ts"] + item["dur"]
    return total


def test_profiled_steps_give_a_trace_and_a_summary_of_all_its_time(tmp_path, capsys):
    """Steps 2-3 of 3: profile/rank-0.json is a Chrome trace holding matmuls and the optimizer step; the summary's
    categories add up to its total, which is the trace's outermost operators' time; a memory snapshot on CPU is one
    line and nothing else."""
    cfg = load_config(
        None,
        [
            "model.preset=llama-tiny",
            "data.max_documents=20",
            "data.seq_len=32",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=3",
            "train.global_batch_size=4",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'run'}",
            "run.profile_steps=2-3",
            "run.memory_snapshot_steps=1-2",
        ],
        env={},
    )
    train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    out = capsys.readouterr().out
    trace = json.loads((tmp_path / "run" / "profile" / "rank-0.json").read_text())
    names = {item.get("name") for item in trace["traceEvents"]}
    assert "aten::mm" in names and any(str(name).startswith("Optimizer.step") for name in names)
    rows = dict(re.findall(r"^  (\w+)\s+([\d.]+) ms", out, re.MULTILINE))
    assert set(rows) == {*CATEGORIES, "total"}, out
    parts = sum(float(rows[name]) for name in CATEGORIES)
    assert parts == pytest.approx(float(rows["total"]), abs=0.01)
    assert float(rows["matmul"]) > 0 and float(rows["optimizer"]) > 0 and float(rows["communication"]) == 0
    assert float(rows["total"]) * 1e3 == pytest.approx(top_level_microseconds(trace), rel=1e-3)
    assert "profile of steps 2-3 on rank 0, CPU time of operators (own, children excluded" in out
    per_step = dict(re.findall(r"^  (\w+)\s+[\d.]+ ms\s+([\d.]+) ms/step", out, re.MULTILINE))
    assert float(per_step["total"]) == pytest.approx(float(rows["total"]) / 2, abs=0.002)
    assert "GPU was busy" not in out
    assert "CUDA memory snapshots need a GPU; this run is on cpu, nothing recorded" in out
    assert not (tmp_path / "run" / "memory").exists()
