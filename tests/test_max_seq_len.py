"""``meshtron plan --max-seq-len``: the longest sequence that fits, the settings it needs (activation offloading, tiled
MLPs, checkpointing), and a CPU run at that length keeping what the planner planned for it."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.models.presets import make_preset_config
from meshtron.plan.hardware import hardware
from meshtron.plan.layout import Workload
from meshtron.plan.longest import GRANULARITY, fastest_fit, longest_sequence
from meshtron.plan.model_shape import ModelShape

# llama-deep (8 blocks) planned as the CPU runs it: fp32, eager, no document masks (whose dense CPU mask grows with
# the square of the length), one sequence a step, on a "GPU" of 40 MB
BASE = Workload(seq_len=GRANULARITY, global_batch=1, compute_dtype="float32", device="cpu", compiled=False,
                mask_documents=False)  # fmt: skip


def llama_deep(positions: int = 65536):
    from meshtron.config import ModelConfig

    hf_config = make_preset_config("llama-deep", 257)
    hf_config.max_position_embeddings = positions
    return hf_config, ModelShape.from_hf_config(hf_config, ModelConfig(preset="llama-deep"), None)


def plan_longest(gpus: int, gpu_memory_gb: float, *extra: str) -> int:
    """``meshtron plan --max-seq-len`` for llama-deep extended to 65,536 positions on ``gpus`` GPUs of
    ``gpu_memory_gb`` (nothing reserved) with 1 GB of host memory each; its exit status."""
    from meshtron.cli import main

    return main(
        ["plan", "--model", "llama-deep", "--gpus", str(gpus), "--max-seq-len", "--max-position-embeddings", "65536",
         "--gpu-memory", f"{gpu_memory_gb}GB", "--reserved-gb", "0", "--host-memory-gb", "1", *extra]
    )  # fmt: skip


CPU_RUN = ["--mixed-precision", "none", "--no-compile", "--no-mask-documents"]
"""How the CPU runs below train: fp32, eager, no document masks (as BASE)."""


def small_gpu(host_gb: float, memory_gb: float = 0.04):
    return hardware("h100").with_overrides(memory_gb=memory_gb, reserved_gb=0.0, host_memory_gb=host_gb)


def test_the_longest_sequence_is_the_last_length_that_fits_and_offloading_lengthens_it():
    hf_config, shape = llama_deep()
    roomy, cramped = (longest_sequence(shape, hf_config, BASE, 1, small_gpu(host)) for host in (1.0, 0.001))
    for found, host in ((roomy, 1.0), (cramped, 0.001)):
        assert found.bound == "memory"
        assert fastest_fit(shape, hf_config, BASE, found.seq_len, 1, small_gpu(host)) is not None
        assert fastest_fit(shape, hf_config, BASE, found.seq_len + GRANULARITY, 1, small_gpu(host)) is None
    # with host memory to fill, offloading (and checkpointing, tiles) double the length; with none, it cannot help
    assert roomy.workload.activation_offload and roomy.candidate.layout.activation_checkpointing == "full"
    assert roomy.workload.mlp_tiles > 1 and roomy.candidate.memory.host > 0
    assert not cramped.workload.activation_offload and roomy.seq_len >= 2 * cramped.seq_len, (roomy, cramped)
    # the model's positions stop it first when they are fewer
    hf_short, _ = llama_deep(positions=2048)
    assert longest_sequence(shape, hf_short, BASE, 1, small_gpu(1.0)).bound == "positions"


def test_a_run_at_the_longest_planned_length_keeps_what_the_planner_planned(tmp_path, cache_dir, capsys):
    """The planner's answer on a 15 MB "GPU", trained for 2 steps on CPU with the emitted config: what it offloads
    within 25% of the planned host activation bytes, next to nothing left on the device. The answer keeps the model
    state in host memory (fsdp.cpu_offload: FSDP over a one-rank group, which the test makes itself)."""
    import torch
    import torch.distributed as dist

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.plan.memory import config_view, host_activation_bytes
    from meshtron.train.trainer import train

    hf_config, shape = llama_deep()
    found = longest_sequence(shape, hf_config, BASE, 1, small_gpu(1.0, memory_gb=0.015))
    emitted = tmp_path / "longest.toml"
    code = plan_longest(1, 0.015, *CPU_RUN, "--emit-config", str(emitted))
    printed = capsys.readouterr().out
    assert code == 0 and f"the longest sequence is {found.seq_len:,} tokens" in printed, printed
    assert "train.activation_offload=true" in printed and "train.activation_checkpointing=full" in printed
    run_settings = [
        f"data.cache_dir={cache_dir}",
        "data.max_documents=400",
        "train.steps=2",
        "run.progress=false",
        "checkpoint.interval=0",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(str(emitted), run_settings, env={})
    assert (cfg.data.seq_len, cfg.train.activation_offload, cfg.train.mlp_tiles) == (found.seq_len, True, 8)
    assert cfg.fsdp.cpu_offload and found.workload.cpu_offload  # the state in host memory too, on this "GPU"
    planned = max(host_activation_bytes(*config_view(cfg, 1, device="cpu")))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"{found.seq_len} tokens: offloaded {result.offloaded_bytes:,} B (planned {planned:,.0f}), "
          f"{result.activation_bytes:,} B left on the device")  # fmt: skip
    assert abs(result.offloaded_bytes / planned - 1) <= 0.25
    assert result.activation_bytes <= 0.05 * result.offloaded_bytes


def test_max_seq_len_refuses_a_length_too():
    from meshtron.cli import main

    assert main(["plan", "--model", "llama-deep", "--gpus", "1", "--max-seq-len", "--seq-len", "1024"]) == 2


def test_savings_are_tried_only_where_they_apply():
    from meshtron.plan.longest import savings_variants

    _, shape = llama_deep()
    variants = savings_variants(shape, BASE)
    tried = {(w.activation_offload, w.mlp_tiles) for w in variants}
    assert len(variants) == 8 and sum(w.cpu_offload for w in variants) == 4
    assert tried == {(False, 0), (False, 8), (True, 0), (True, 8)}  # each with the state on the GPU and on the host
    offloading = dataclasses.replace(BASE, activation_offload=True, mlp_tiles=4)
    assert {(w.activation_offload, w.mlp_tiles) for w in savings_variants(shape, offloading)} == {(True, 0), (True, 4)}


def test_the_planner_keeps_the_model_state_in_host_memory_under_cpu_offload():
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.errors import ConfigError
    from meshtron.plan.layout import Layout
    from meshtron.plan.memory import estimate_memory

    hf_config, shape = llama_deep()
    hosted = dataclasses.replace(BASE, cpu_offload=True)
    on_gpu, on_host = estimate_memory(shape, Layout(), BASE), estimate_memory(shape, Layout(), hosted)
    assert on_host.state == on_gpu.state and on_host.peak_state == 0  # the same bytes, in host memory
    assert on_host.host == on_gpu.params + on_gpu.grads + on_gpu.optimizer
    assert on_gpu.gathered == 0 < on_host.gathered  # FSDP over one rank: the blocks being computed, gathered
    Layout().check(hf_config, hosted)  # one GPU: FSDP over one rank
    with pytest.raises(ConfigError, match="fsdp.cpu_offload needs FSDP"):
        Layout(ParallelDims(tp=2)).check(hf_config, hosted)


def test_a_rehearsed_rank_of_four_gpus_at_the_longest_planned_length_keeps_what_was_planned(tmp_path, cache_dir):
    """``--max-seq-len`` for 4 "GPUs" of 10 MB (1 GB of host memory each), then rank 0 of that layout rehearsed on
    CPU (``meshtron train --rehearse``: one process on a fake group): its state and the activations it offloads
    within 10% of the plan for that rank."""
    from meshtron.config import load_config
    from meshtron.plan.rehearsal import format_rehearsal, rehearse

    emitted = tmp_path / "longest4.toml"
    code = plan_longest(4, 0.01, *CPU_RUN, "--emit-config", str(emitted))
    assert code == 0
    settings = [f"data.cache_dir={cache_dir}", "data.max_documents=400", f"run.output_dir={tmp_path / 'rehearsal'}"]
    cfg = load_config(str(emitted), settings, env={})
    assert cfg.train.activation_offload and cfg.data.seq_len > 2 * GRANULARITY
    report = rehearse(cfg, 4, 0, steps=2)
    print(format_rehearsal(report))
    for key in ("state_bytes", "host_activation_bytes"):
        measured, planned = report.measured[key], report.planned[key]
        assert abs(measured / planned - 1) <= 0.10, (key, measured, planned)


def test_max_seq_len_as_json_is_one_document(capsys):
    import json

    code = plan_longest(1, 0.04, "--json")
    record = json.loads(capsys.readouterr().out)  # nothing else printed
    assert code == 0 and record["bound"] == "memory" and record["seq_len"] % GRANULARITY == 0
    assert record["workload"]["seq_len"] == record["seq_len"] and record["candidate"]["fits"]
    assert record["candidate"]["memory_gb"]["host"] > 0


def test_plan_model_dtype_bfloat16_stores_the_weights_in_half_the_bytes(capsys):
    import json

    from meshtron.cli import main

    params = {}
    for dtype in ("float32", "bfloat16"):
        assert main(["plan", "--model", "llama-deep", "--gpus", "1", "--seq-len", "256", "--json", "--model-dtype",
                     dtype]) == 0  # fmt: skip
        record = json.loads(capsys.readouterr().out)
        assert record["workload"]["model_dtype"] == dtype
        params[dtype] = record["candidates"][0]["memory_gb"]["params"]
    assert params["bfloat16"] == pytest.approx(params["float32"] / 2)
