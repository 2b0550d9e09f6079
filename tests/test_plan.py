"""meshtron plan: the planner's numbers against the real sharding code (dry runs of 8B / 70B shapes at
8 to 512 ranks), its command line, its emitted configs, its precision / loss-chunking / device rules,
and the activations of one-process bf16 / fp16 CPU runs. The comparison with measured memory of every
parity layout is in test_parity.py (it reuses those runs); bench/dry_run.py times the dry runs."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import REPO, worker_env

# (name, world size, rank, layout overrides): FSDP alone (and with its state in pinned host memory), HSDP x TP,
# PP x FSDP x TP (interleaved, the last rank, which holds the head), and a 512-rank 3-D layout of the 70B shape.
DRY_RUNS = [
    ("8b_fsdp8", 8, 0, ["model.preset=llama-8b", "train.global_batch_size=8"]),
    ("8b_fsdp8_cpu_offload", 8, 0, ["model.preset=llama-8b", "train.global_batch_size=8", "fsdp.cpu_offload=true"]),
    (
        "8b_hsdp_tp2_16",
        16,
        5,
        ["model.preset=llama-8b", "parallel.tp=2", "parallel.dp_replicate=2", "train.global_batch_size=16"],
    ),
    (
        "70b_pp4_tp8_64_last",
        64,
        63,
        [
            "model.preset=llama-70b",
            "parallel.tp=8",
            "parallel.pp=4",
            "parallel.pp_schedule=Interleaved1F1B",
            "train.global_batch_size=16",
        ],
    ),
    (
        "70b_pp8_tp8_512",
        512,
        0,
        ["model.preset=llama-70b", "parallel.tp=8", "parallel.pp=8", "train.global_batch_size=64"],
    ),
]


def plan_cli(capsys, *args: str):
    """``meshtron plan ARGS`` in this process (transformers is imported once for the whole session):
    (exit status, stdout, stderr)."""
    from meshtron.cli import main

    capsys.readouterr()
    status = main(["plan", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry")
    cases = [
        {
            "name": name,
            "world": world,
            "rank": rank,
            "overrides": overrides + ["data.seq_len=4096", f"run.output_dir={out / name}"],
        }
        for name, world, rank, overrides in DRY_RUNS
    ]
    (out / "cases.json").write_text(json.dumps(cases))
    import subprocess

    proc = subprocess.run(
        [sys.executable, "tests/dry_run_worker.py", str(out / "cases.json")],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}


@pytest.mark.parametrize("name", [case[0] for case in DRY_RUNS])
def test_dry_run_agrees_with_planner(name, dry_runs):
    got = dry_runs[name]
    print(
        f"{name}: dry run {got['params'] / 1e9:.3f} GB parameters vs planner {got['planned_params'] / 1e9:.3f} GB "
        f"in {got['seconds']:.1f} s"
    )
    assert abs(got["params"] - got["planned_params"]) <= 0.05 * got["params"]
    assert got["grads"] == got["params"] and got["optimizer"] == 2 * got["params"]  # AdamW: two moments per weight
    if "pinning" in got:  # fsdp.cpu_offload: each shard pinned apart, rounded up to a power of two by the allocator
        print(f"{name}: pinning adds {got['pinning'] / 1e9:.3f} GB, planned {got['planned_pinning'] / 1e9:.3f} GB")
        assert got["pinning"] > 0.05 * got["params"] and got["planned_pinning"] == got["pinning"]


def test_plan_ranks_layouts_and_emits_a_config_that_loads(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    args = ["--model", "llama-8b", "--gpus", "16", "--seq-len", "4096", "--global-batch", "32"]
    status, stdout, stderr = plan_cli(capsys, *args, "--json", "--emit-config", str(out))
    assert status == 0, stderr[-3000:]
    candidates = json.loads(stdout[: stdout.rindex("}") + 1])["candidates"]
    assert candidates[0]["fits"] and candidates[0]["memory_gb"]["total"] <= 80 - 3
    assert any(not c["fits"] for c in candidates), "nothing was rejected: the memory check is vacuous"
    for c in candidates:
        layout = c["layout"]
        assert layout["dp_replicate"] * layout["dp_shard"] * layout["cp"] * layout["tp"] * layout["pp"] == 16
    fitting = [c["tokens_per_s"] for c in candidates if c["fits"]]
    assert candidates[0]["tokens_per_s"] >= 0.98 * max(fitting)

    from meshtron.config import load_config
    from meshtron.distributed.mesh import ParallelDims

    cfg = load_config(out, env={})
    best = candidates[0]["layout"]
    dims = ParallelDims.from_config(cfg.parallel, 16)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == tuple(
        best[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    )
    assert cfg.data.seq_len == 4096 and cfg.train.global_batch_size == 32 and cfg.model.preset == "llama-8b"

    written = out.read_text()
    status, _, stderr = plan_cli(capsys, *args, "--emit-config", str(out))
    assert status == 2 and "already exists" in stderr
    assert out.read_text() == written  # untouched


def test_plan_table_and_errors(capsys):
    status, stdout, stderr = plan_cli(
        capsys,
        "--model",
        "llama-tiny",
        "--gpus",
        "4",
        "--seq-len",
        "256",
        "--global-batch",
        "8",
        "--gpu",
        "a100",
        "--gpu-memory",
        "40GB",
        "--reserved-gb",
        "2.5",
    )
    assert status == 0, stderr[-2000:]
    assert "\n* " in stdout and "layouts fit in 38 GB" in stdout  # 37.5 GB usable
    status, _, stderr = plan_cli(
        capsys,
        "--model",
        "llama-tiny",
        "--gpus",
        "4",
        "--seq-len",
        "256",
        "--global-batch",
        "8",
        "--link-efficiency",
        "0",
    )
    assert status == 2 and "--link-efficiency must be positive" in stderr
    status, stdout, _ = plan_cli(
        capsys, "--model", "llama-70b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8"
    )
    assert status == 1 and "nothing fits" in stdout
    status, _, stderr = plan_cli(
        capsys, "--model", "llama-8b", "--gpus", "8", "--seq-len", "8", "--global-batch", "8", "--gpu", "v100x"
    )
    assert status == 2 and "--gpu: unknown GPU 'v100x'" in stderr
    status, _, stderr = plan_cli(
        capsys, "--model", "llama-8b", "--gpus", "12", "--seq-len", "8", "--global-batch", "12"
    )
    assert status == 2 and "whole number of nodes" in stderr
    status, _, stderr = plan_cli(
        capsys, "--model", "llama-8b", "--gpus", "8", "--seq-len", "16384", "--global-batch", "8"
    )
    assert status == 2 and "max_position_embeddings 8192" in stderr


def test_parameter_split_rules():
    from meshtron.plan.model_shape import ParamSpec

    kv = ParamSpec("k_proj.weight", (256, 1024), "kv_colwise")
    assert kv.local_numel(tp=2, fsdp=1, num_kv_heads=2) == 128 * 1024
    assert kv.local_numel(tp=4, fsdp=1, num_kv_heads=2) == 256 * 1024  # replicated when tp > KV heads
    row = ParamSpec("o_proj.weight", (1024, 1024), "rowwise")
    assert row.local_numel(tp=4, fsdp=3, num_kv_heads=8) == 342 * 256  # FSDP's first rank takes the ceiling
    assert ParamSpec("norm.weight", (1024,), "norm").local_numel(tp=8, fsdp=1, num_kv_heads=8) == 1024


@pytest.mark.parametrize("preset", ["llama-1b", "llama-deep"])
def test_every_proposed_layout_passes_meshtron_preflight(preset):
    """Each candidate, written as a train config, is accepted by ``meshtron train``'s own checks: pipelines,
    interleaved ones included, for llama-1b (tied embeddings: the last stage holds a copy of them) and for
    llama-deep (8 untied layers)."""
    from meshtron.config import ModelConfig
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.report import train_config
    from meshtron.plan.search import candidate_layouts
    from meshtron.train.setup.preflight import preflight

    hf_config = make_preset_config(preset, 259)
    shape = ModelShape.from_hf_config(hf_config)
    workload = Workload(seq_len=1024, global_batch=32)
    layouts = candidate_layouts(shape, hf_config, workload, 16, hardware("h100"))
    assert {layout.dims.cp for layout in layouts} >= {1, 2, 4}
    schedules = {layout.parallel.pp_schedule for layout in layouts if layout.dims.pp > 1}
    assert schedules == {"1F1B", "Interleaved1F1B"}
    for layout in layouts:
        setup = preflight(train_config(layout, workload, ModelConfig(preset=preset)), 16, "cuda")
        assert setup.dims.product == 16 and (setup.dims.tp, setup.dims.cp, setup.dims.pp) == (
            layout.dims.tp,
            layout.dims.cp,
            layout.dims.pp,
        )


def _llama_1b():
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.model_shape import ModelShape

    hf_config = make_preset_config("llama-1b", 259)
    return hf_config, ModelShape.from_hf_config(hf_config)


def test_layouts_without_fsdp_compute_in_the_mixed_precision_dtype():
    """One GPU, TP-only and PP-only layouts compute in bf16 like FSDP ones (precision.mixed_precision): bf16
    elements and the bf16 peak, not fp32's; a ``none`` workload is the fp32 one."""
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import block_activation_per_token, compute_bytes
    from meshtron.plan.throughput import estimate_step

    hf_config, shape = _llama_1b()
    bf16, fp32 = Workload(seq_len=2048, global_batch=8), Workload(seq_len=2048, global_batch=8, compute_dtype="float32")
    assert (compute_bytes(bf16), compute_bytes(fp32)) == (2, 4)
    assert (bf16.mixed_precision, fp32.mixed_precision) == ("bf16", "none")
    hw = hardware("h100")
    single = Layout(micro_batch=1)
    mfu_bf16 = estimate_step(shape, single, bf16, hw, hf_config).mfu
    mfu_fp32 = estimate_step(shape, single, fp32, hw, hf_config).mfu
    print(f"llama-1b on one H100, seq 2048, batch 8: MFU {mfu_bf16:.1%} in bf16, {mfu_fp32:.1%} in fp32")
    # fp32 matmuls run at 67 of the bf16 989 TFLOP/s; the step's memory-bound kernels (optimizer, elementwise) barely
    # change, so the whole step is 5-15x slower
    assert mfu_bf16 > 0.25 and mfu_bf16 > 5 * mfu_fp32
    for layout in (single, Layout(ParallelDims(tp=2)), Layout(ParallelDims(pp=2), micro_batch=1)):
        assert not layout.dims.fsdp_enabled
        ratio = block_activation_per_token(shape, layout, bf16) / block_activation_per_token(shape, layout, fp32)
        assert 0.5 <= ratio < 0.6, layout  # bf16 elements; only the norms' fp32 upcasts and the log-sum-exp stay


def test_one_gpu_plan_predicts_bf16_throughput(capsys):
    status, stdout, stderr = plan_cli(
        capsys, "--model", "llama-1b", "--gpus", "1", "--seq-len", "2048", "--global-batch", "8", "--json"
    )
    assert status == 0, stderr[-2000:]
    best = json.loads(stdout[: stdout.rindex("}") + 1])["candidates"][0]
    print(
        f"llama-1b, 1 x H100: micro {best['layout']['micro_batch']} {best['layout']['activation_checkpointing']}, "
        f"{best['memory_gb']['total']:.1f} GB, {best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}"
    )
    assert best["fits"] and best["mfu"] > 0.25  # fp32 compute predicted 2.4%


@pytest.mark.parametrize("precision", ["bf16", "none"])
def test_emitted_config_sets_train_mixed_precision(tmp_path, capsys, precision):
    from meshtron.config import load_config
    from meshtron.plan.layout import Workload

    out = tmp_path / "one.toml"
    status, _, stderr = plan_cli(
        capsys,
        "--model",
        "llama-1b",
        "--gpus",
        "1",
        "--seq-len",
        "2048",
        "--global-batch",
        "8",
        "--mixed-precision",
        precision,
        "--loss-chunk-size",
        "2048",
        "--emit-config",
        str(out),
    )
    assert status == 0, stderr[-2000:]
    text = out.read_text()
    assert "param_dtype" not in text and f'mixed_precision = "{precision}"' in text
    cfg = load_config(out, env={})  # fsdp.param_dtype would be a ConfigError
    assert cfg.precision.mixed_precision == precision and cfg.train.loss_chunk_size == 2048
    workload = Workload.from_config(cfg)
    assert workload.compute_dtype == {"bf16": "bfloat16", "none": "float32"}[precision]
    assert workload.loss_chunk_size == 2048 and workload.device == "cuda"


def test_workload_from_config_resolves_mixed_precision_per_device():
    from meshtron.config import load_config
    from meshtron.plan.layout import Workload

    auto = load_config(None, [], env={})
    assert Workload.from_config(auto).compute_dtype == "bfloat16"  # auto on a GPU
    assert Workload.from_config(auto, device="cpu").compute_dtype == "float32"  # auto on CPU: none
    fp16 = load_config(None, ["precision.mixed_precision=fp16", "train.loss_chunk_size=0"], env={})
    cpu = Workload.from_config(fp16, device="cpu")
    assert (cpu.compute_dtype, cpu.mixed_precision, cpu.loss_chunk_size, cpu.device) == ("float16", "fp16", 0, "cpu")
    half = load_config(None, ["model.dtype=bfloat16"], env={})
    assert Workload.from_config(half).mixed_precision == "none"  # auto keeps half-precision weights' own dtype


NON_DEFAULT_SETTINGS = {
    "data.seq_len": 1234,
    "train.global_batch_size": 48,
    "model.dtype": "bfloat16",
    "precision.mixed_precision": "fp16",
    "data.mask_documents": False,
    "train.loss_chunk_size": 1024,
    "fsdp.accumulate_unsharded": True,
    "train.compile": "false",
    "model.attn_implementation": "eager",
    "optimizer.name": "muon",
    "optimizer.settings": {"muon": {"ns_steps": 3}},
    "precision.float8": True,
    "precision.float8_recipe": "rowwise",
    "train.mlp_tiles": 4,
    "train.activation_offload": True,
    "fsdp.cpu_offload": True,
    "train.objective": "dpo",
    "preference.reference": "precomputed",
    "preference.reference_dtype": "bfloat16",
    "distill.teacher": None,
    "distill.teacher_dtype": None,
    "distill.divergence": "forward_kl",
}
"""A value other than the default for every setting the planner's Workload holds but the teacher's, which a
preference objective cannot take (``DISTILL_SETTINGS``)."""

DISTILL_SETTINGS = {
    **NON_DEFAULT_SETTINGS,
    "train.objective": "distill",
    "preference.reference": "auto",
    "preference.reference_dtype": None,
    "distill.teacher": "llama-mini",
    "distill.teacher_dtype": "float32",
    "distill.divergence": "jsd",
}
"""The other settings of ``NON_DEFAULT_SETTINGS`` with a distillation teacher instead of a preference objective."""


def test_config_and_workload_map_each_other_through_one_table():
    """Config -> Workload -> Config gives back every setting WORKLOAD_SETTINGS maps, each set to a non-default
    value, and the table maps every Workload field but the device (issue 58: one table used both ways)."""
    import dataclasses

    from meshtron.config import Config, ModelConfig
    from meshtron.plan.layout import WORKLOAD_SETTINGS, Layout, Workload
    from meshtron.plan.report import train_config

    assert {s.field_name for s in WORKLOAD_SETTINGS} == {f.name for f in dataclasses.fields(Workload)} - {"device"}
    assert [s.key for s in WORKLOAD_SETTINGS] == list(NON_DEFAULT_SETTINGS) == list(DISTILL_SETTINGS)
    defaults = Config()
    for setting in WORKLOAD_SETTINGS:
        given = (NON_DEFAULT_SETTINGS[setting.key], DISTILL_SETTINGS[setting.key])
        assert any(value != setting.read(defaults) for value in given), setting.key
    for settings in (NON_DEFAULT_SETTINGS, DISTILL_SETTINGS):
        cfg = Config()
        for setting in WORKLOAD_SETTINGS:
            setting.write(cfg, settings[setting.key])
        for device in ("cuda", "cpu"):
            workload = Workload.from_config(cfg, device)
            back = train_config(Layout(), workload, ModelConfig())
            assert {s.key: s.read(back) for s in WORKLOAD_SETTINGS} == settings
            assert Workload.from_config(back, device) == workload


def test_the_planners_layout_is_degrees_and_options_without_copies():
    """One description of the degrees (ParallelDims) and one of the other [parallel] settings (ParallelOptions):
    ParallelConfig is exactly both, the planner's Layout holds both and repeats none of their fields or properties
    (issue 58: PARALLEL_CHOICES and the pass-through properties gone)."""
    import dataclasses

    import meshtron.plan.layout as plan_layout
    from meshtron.config import ParallelConfig, ParallelOptions
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.layout import Layout

    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (ParallelConfig, ParallelDims, ParallelOptions)}
    assert names[ParallelConfig] == names[ParallelDims] | names[ParallelOptions]
    assert not names[ParallelDims] & names[ParallelOptions]
    given = ParallelConfig()
    assert all(getattr(ParallelOptions(), name) == getattr(given, name) for name in names[ParallelOptions])
    assert not hasattr(plan_layout, "PARALLEL_CHOICES")
    layout_fields = {f.name for f in dataclasses.fields(Layout)}
    assert layout_fields == {"dims", "parallel", "micro_batch", "activation_checkpointing"}
    degree_names = names[ParallelDims] | {name for name, v in vars(ParallelDims).items() if isinstance(v, property)}
    repeated = [name for name in degree_names | names[ParallelConfig] if hasattr(Layout, name)]
    assert repeated == [], f"the planner's Layout repeats {repeated}"
    resolved = ParallelConfig(dp_shard=2, tp=2, cp_method="allgather", pp_schedule="GPipe")
    assert ParallelDims.from_config(resolved, 4).to_config(resolved.options()) == resolved


def test_fused_loss_memory_at_llama_1b():
    """The fused chunked loss keeps no fp32 log-softmax for backward but its fp32 head-weight gradient, and holds
    one chunk's logits at a time: llama-1b (128,256 vocabulary, hidden 2,048), seq 2048, micro batch 4 (8,192
    tokens, two 4,096-token chunks), against the unfused loss (train.loss_chunk_size=0)."""
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import activation_bytes, estimate_memory

    _, shape = _llama_1b()
    layout = Layout(micro_batch=4)
    fused = Workload(seq_len=2048, global_batch=4)
    whole = Workload(seq_len=2048, global_batch=4, loss_chunk_size=0)
    saved = activation_bytes(shape, layout, whole)[0] - activation_bytes(shape, layout, fused)[0]
    transient = estimate_memory(shape, layout, whole).temporaries - estimate_memory(shape, layout, fused).temporaries
    print(
        f"llama-1b, seq 2048 x micro batch 4: the fused loss saves {saved / 1e9:.2f} GB of activations "
        f"({saved:,.0f} B) and {transient / 1e9:.2f} GB of transient logits ({transient:,} B)"
    )
    tokens, vocab, hidden = 4 * 2048, 128256, 2048
    assert saved == tokens * vocab * 4 - vocab * hidden * 4  # the fp32 log-softmax, less the fp32 weight gradient
    # unfused: bf16 logits, fp32 copy and fp32 gradient of every token; fused: one chunk's bf16 logits, fp32 copy
    # and bf16 gradient
    assert transient == tokens * vocab * (2 + 4 + 4) - 4096 * vocab * (2 + 4 + 2)
    short = Layout(micro_batch=1)  # 2,048 tokens: one chunk of 2,048
    assert estimate_memory(shape, short, fused).temporaries == 2048 * vocab * (2 + 4 + 2)


def test_accumulation_holds_gradient_shards_unless_asked_to_hold_them_whole():
    """Llama-3-70B on 64 GPUs, tp 8 x dp_shard 8, micro batch 1 of a 256-sequence global batch (32
    accumulated micro-batches): the default holds gradient shards and reduce-scatters 32 times;
    fsdp.accumulate_unsharded holds each rank's full tp-share of the gradients in fp32 (~35 GB) and
    reduce-scatters once. (tests/test_parity.py measures both against real runs.)"""
    from meshtron.config import ModelConfig
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import estimate_memory
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.throughput import estimate_step

    hf_config = make_preset_config("llama-70b", 257)
    shape = ModelShape.from_hf_config(hf_config, ModelConfig(preset="llama-70b"))
    layout = Layout(ParallelDims(dp_shard=8, tp=8), micro_batch=1)
    sharded, whole = (Workload(8192, 256, accumulate_unsharded=flag) for flag in (False, True))
    memory = {w: estimate_memory(shape, layout, w) for w in (sharded, whole)}
    assert memory[sharded].grads == memory[sharded].params  # fp32 shards, like the parameters
    full_tp_share = memory[sharded].params * 8  # undo dp_shard 8 (the 257-token vocabulary pads nothing)
    assert abs(memory[whole].grads - full_tp_share) <= 0.01 * full_tp_share
    print(
        f"70b tp8 x shard8, 32 micro-batches: gradients held {memory[sharded].grads / 1e9:.1f} GB (default) vs "
        f"{memory[whole].grads / 1e9:.1f} GB (accumulate_unsharded)"
    )
    hw = hardware("h100")
    default_step, deferred_step = (estimate_step(shape, layout, w, hw, hf_config) for w in (sharded, whole))
    assert deferred_step.exposed_comm_s <= default_step.exposed_comm_s
    # A layout with one micro-batch per step is unaffected.
    single = Layout(ParallelDims(dp_shard=8, tp=8), micro_batch=4)
    assert estimate_memory(shape, single, Workload(8192, 32)) == estimate_memory(
        shape, single, Workload(8192, 32, accumulate_unsharded=True)
    )


def test_document_mask_term_only_off_cuda():
    """SDPA's dense document mask (CPU) costs ``seq_len`` elements per token per block; FlexAttention's
    block mask (CUDA) nothing."""
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import block_activation_per_token

    _, shape = _llama_1b()
    per_device = {
        device: block_activation_per_token(shape, Layout(), Workload(2048, 8, device=device))
        for device in ("cuda", "cpu")
    }
    assert per_device["cpu"] - per_device["cuda"] == 2 * 2048
    unmasked = Workload(2048, 8, mask_documents=False, device="cpu")
    assert block_activation_per_token(shape, Layout(ParallelDims(pp=2)), unmasked) < per_device["cpu"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["precision.mixed_precision=bf16"],
        ["precision.mixed_precision=bf16", "train.loss_chunk_size=48"],
        ["precision.mixed_precision=fp16", "precision.fp16_initial_loss_scale=1024"],
    ],
    ids=["bf16", "bf16_chunked", "fp16"],
)
def test_planned_half_precision_activations_match_a_cpu_run(tmp_path, cache_dir, overrides):
    """One process computing in bf16 / fp16 on CPU (llama-deep, 8 x 32 tokens): the planner's activations,
    bf16 weight copies included, against what autograd kept (the parity tests check every layout)."""
    import torch

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.plan.memory import activation_bytes, config_view
    from meshtron.train.trainer import train

    cfg = load_config(
        None,
        [
            "model.preset=llama-deep",
            "data.max_documents=40",
            "data.seq_len=32",
            f"data.cache_dir={cache_dir}",
            "train.steps=2",
            "train.global_batch_size=8",
            "run.progress=false",
            f"run.output_dir={tmp_path}",
        ]
        + overrides,
        env={},
    )
    measured = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))).activation_bytes
    planned = max(activation_bytes(*config_view(cfg, 1, device="cpu")))
    print(f"{' '.join(overrides)}: measured {measured:,} B, planned {planned:,.0f} B (x{planned / measured:.3f})")
    assert abs(planned / measured - 1) <= 0.10


# ---------------------------------------------------------------------------------------------- expert parallelism


def _moe_config(layers: int = 2, **overrides):
    """qwen3moe-tiny (4 experts, top-2) with ``layers`` layers and any other config overrides."""
    from meshtron.models.presets import make_preset_config

    hf_config = make_preset_config("qwen3moe-tiny", 259)
    hf_config.num_hidden_layers = layers
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    return hf_config


@pytest.fixture(scope="module")
def big_experts():
    """A Qwen3-30B-A3B-like sparse block (hidden 2048, 128 experts of 768, top-8) in 4 layers (few layers keep the
    meta build fast; every layer is alike, so the per-layer trade-offs are the full model's)."""
    from transformers import Qwen3MoeConfig

    from meshtron.plan.model_shape import ModelShape

    hf_config = Qwen3MoeConfig(
        hidden_size=2048,
        num_hidden_layers=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    )
    return hf_config, ModelShape.from_hf_config(hf_config)


def test_planner_proposes_expert_parallelism_for_big_experts(big_experts):
    """64 H100s, one 4096-token sequence per GPU: FSDP would gather all 128 experts of every block over the
    network twice per step; expert parallelism inside a node gathers only E / ep of them (over efsdp) at the
    price of the token all-to-alls, and is proposed. The same workload on a dense model never gets an ep."""
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Workload
    from meshtron.plan.search import candidate_layouts, plan_layouts

    hf_config, shape = big_experts
    hw = hardware("h100")
    workload = Workload(seq_len=4096, global_batch=64)
    candidates = plan_layouts(shape, hf_config, workload, 64, hw)
    best = candidates[0]
    print(
        f"big experts on 64 H100s: best {best.layout.dims.describe()} micro {best.layout.micro_batch}, "
        f"{best.step.tokens_per_s / 64:,.0f} tokens/s/GPU, all-to-all {best.step.all_to_all_s * 1e3:.1f} ms of "
        f"{best.step.seconds * 1e3:.0f} ms"
    )
    assert best.fits and best.layout.dims.ep > 1
    assert best.step.all_to_all_s > 0
    fastest_without = max(c.step.tokens_per_s for c in candidates if c.fits and c.layout.dims.ep == 1)
    assert best.step.tokens_per_s > 1.02 * fastest_without  # faster, not a tie-break
    assert {c.layout.dims.ep for c in candidates} >= {1, 2, 4, 8, 16, 32, 64}

    dense_config, dense = _llama_1b()
    assert {layout.dims.ep for layout in candidate_layouts(dense, dense_config, workload, 64, hw)} == {1}


def test_expert_degrees_follow_meshtrons_rules():
    """Only ep values meshtron accepts are proposed: dividing the experts (6 here) and dp_shard x cp; ep on a dense
    model, or one that does not divide the experts, is refused by meshtron's own checks (``Layout.check``)."""
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.errors import ConfigError
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.search import candidate_layouts

    hf_config = _moe_config(num_experts=6)
    shape = ModelShape.from_hf_config(hf_config)
    layouts = candidate_layouts(shape, hf_config, Workload(seq_len=256, global_batch=16), 8, hardware("h100"))
    assert {layout.dims.ep for layout in layouts} == {
        1,
        2,
    }  # 3 and 6 divide the experts, not dp_shard x cp (powers of 2)
    assert all(6 % layout.dims.ep == 0 and layout.fsdp_size % layout.dims.ep == 0 for layout in layouts)
    workload = Workload(seq_len=256, global_batch=16)
    with pytest.raises(ConfigError, match="must divide the model's 6 experts"):
        Layout(ParallelDims(dp_shard=8, ep=4)).check(hf_config, workload)
    with pytest.raises(ConfigError, match=r"must divide parallel.dp_shard\*cp"):
        Layout(ParallelDims(dp_shard=2, tp=2, ep=4)).check(_moe_config(), workload)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        Layout(ParallelDims(dp_shard=2, ep=2)).check(_llama_1b()[0], workload)


def test_every_proposed_moe_layout_passes_meshtron_preflight(tmp_path):
    """Each candidate for a 4-layer qwen3moe-tiny on 8 GPUs, written as a train config, passes ``meshtron train``'s
    checks, and parallel.ep round-trips; pipelines with ep are proposed exactly where meshtron accepts them."""
    from meshtron.config import ModelConfig, load_config, to_toml
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.errors import ConfigError
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.report import train_config
    from meshtron.plan.search import candidate_layouts
    from meshtron.train.setup.preflight import preflight

    hf_config = _moe_config(layers=4)
    hf_config.save_pretrained(tmp_path / "moe")
    model_cfg = ModelConfig(name_or_path=str(tmp_path / "moe"))
    shape = ModelShape.from_hf_config(hf_config)
    workload = Workload(seq_len=256, global_batch=16)
    layouts = [
        layout
        for layout in candidate_layouts(shape, hf_config, workload, 8, hardware("h100"))
        if layout.activation_checkpointing == "none"
    ]
    assert {layout.dims.ep for layout in layouts} == {1, 2, 4}
    with_pp = any(layout.dims.ep > 1 and layout.dims.pp > 1 for layout in layouts)
    seen = set()
    for layout in layouts:
        cfg = train_config(layout, workload, model_cfg)
        setup = preflight(cfg, 8, "cuda")
        assert setup.dims.ep == layout.dims.ep and setup.dims.product == 8
        key = (layout.dims.pp, layout.dims.ep)
        if key not in seen:  # the written TOML loads back to the same layout
            seen.add(key)
            path = tmp_path / f"pp{layout.dims.pp}_ep{layout.dims.ep}.toml"
            path.write_text(to_toml(cfg))
            loaded = load_config(path, env={})
            assert loaded.parallel.ep == layout.dims.ep
            assert Layout.from_config(loaded, 8, hf_config) == layout
    # ep with pp: proposed iff meshtron's preflight takes it.
    try:
        preflight(
            train_config(Layout(ParallelDims(dp_shard=4, pp=2, ep=4), micro_batch=1), workload, model_cfg), 8, "cuda"
        )
        accepted = True
    except ConfigError:
        accepted = False
    assert with_pp == accepted


def test_all_to_all_time_grows_with_ep_and_is_zero_without(big_experts):
    """The EP all-to-alls: none at ep=1; then per MoE layer and micro-batch 4 all-to-alls (dispatch and combine,
    forward and backward) of tokens x top-k x hidden x 2 bytes, (ep - 1) / ep of it leaving each rank -- the
    bytes meshtron's own ``all_to_all_traffic`` counts for evenly spread routing; slower once the ep group
    leaves the node. FSDP's expert traffic shrinks with ep (gathered over efsdp only)."""
    import torch

    from meshtron.distributed.expert_parallel import all_to_all_traffic
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.throughput import estimate_step, expert_all_to_all_bytes

    hf_config, shape = big_experts
    hw = hardware("h100")
    workload = Workload(seq_len=4096, global_batch=64)
    steps = {
        ep: estimate_step(shape, Layout(ParallelDims(dp_shard=64, ep=ep)), workload, hw, hf_config)
        for ep in (1, 2, 4, 8, 16)
    }
    times = [steps[ep].all_to_all_s for ep in (1, 2, 4, 8, 16)]
    print("all-to-all s per step at ep 1, 2, 4, 8, 16: " + ", ".join(f"{t:.4f}" for t in times))
    assert times[0] == 0 and all(a < b for a, b in zip(times, times[1:]))
    assert times[4] > 5 * times[3]  # ep 16 crosses nodes: the network
    assert all(s.exposed_comm_s >= s.all_to_all_s for s in steps.values())

    ep, tokens = 8, 4096  # one micro-batch of one sequence per rank, evenly routed (each rank owns 16 experts)
    layout = Layout(ParallelDims(dp_shard=64, ep=ep))
    routing = [torch.arange(tokens * 8).remainder(128).view(tokens, 8) for _ in range(ep)]
    traffic = all_to_all_traffic(routing, 128, shape.hidden, 2)
    assert expert_all_to_all_bytes(shape, layout, workload) == pytest.approx(traffic.max_sent_bytes())

    dense_fsdp = estimate_step(
        shape, Layout(ParallelDims(dp_shard=64), micro_batch=1), Workload(4096, 64 * 16), hw, hf_config
    )
    sharded = estimate_step(
        shape, Layout(ParallelDims(dp_shard=64, ep=8), micro_batch=1), Workload(4096, 64 * 16), hw, hf_config
    )
    assert sharded.exposed_comm_s - sharded.all_to_all_s <= dense_fsdp.exposed_comm_s


def test_expert_parallel_memory():
    """ep changes no parameter, gradient or AdamW shard (E / ep experts over dp_shard x cp / ep ranks), gathers only
    E / ep experts per block, and keeps one more int64 per (token, expert) pair for backward."""
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import block_activation_per_token, estimate_memory, state_numel
    from meshtron.plan.model_shape import ModelShape

    hf_config = _moe_config()
    shape = ModelShape.from_hf_config(hf_config)
    workload = Workload(seq_len=256, global_batch=8)
    plain, ep = Layout(ParallelDims(dp_shard=4)), Layout(ParallelDims(dp_shard=4, ep=4))
    assert state_numel(shape, plain, workload) == state_numel(shape, ep, workload)
    experts = sum(math.prod(p.shape) for p in shape.block if p.expert)
    fewer = estimate_memory(shape, plain, workload).gathered - estimate_memory(shape, ep, workload).gathered
    assert experts and fewer == experts * 3 // 4 * (
        2 * 2 + 4
    )  # 3 of 4 experts fewer: two bf16 blocks, one fp32 gradient
    extra = block_activation_per_token(shape, ep, workload) - block_activation_per_token(shape, plain, workload)
    assert extra == shape.experts_per_token * 8  # two hidden rows per pair as without EP, an int64 more


def test_rehearse_prints_measured_next_to_planned_and_writes_rehearsal_json(tmp_path, cache_dir):
    """``meshtron train --rehearse``: rank 1 of a tp 2 layout, trained alone on CPU, side by side with the plan."""
    from conftest import run_cli

    out = tmp_path / "rehearsal"
    proc = run_cli(
        [
            "train",
            "--rehearse",
            "--nproc",
            "2",
            "--rank",
            "1",
            "--parallel.tp=2",
            "--model.preset=llama-tiny",
            "--data.seq_len=32",
            "--data.max_documents=40",
            f"--data.cache_dir={cache_dir}",
            "--train.global_batch_size=4",
            f"--run.output_dir={out}",
            "--run.device=cpu",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "meshtron rehearsal: rank 1 of 2 (tp=2) on cpu" in proc.stdout
    assert "measured" in proc.stdout and "planned" in proc.stdout
    got = json.loads((out / "rehearsal.json").read_text())
    assert (got["rank"], got["world_size"]) == (1, 2)
    assert set(got["measured"]) == {
        "state_bytes",
        "activation_bytes",
        "host_activation_bytes",
        "reference_bytes",
        "teacher_bytes",
        "peak_bytes",
        "step_s",
    }
    assert got["measured"]["host_activation_bytes"] == got["planned"]["host_activation_bytes"] == 0  # no offloading
    assert (
        got["measured"]["state_bytes"] > 0 and got["measured"]["activation_bytes"] > 0 and got["measured"]["step_s"] > 0
    )
    # the planner's state for a rank of this layout is exact (no FSDP padding): parameters, gradients, two moments
    assert got["planned"]["state_bytes"] == got["measured"]["state_bytes"]


# (preset, layout, workload settings): valid and invalid layouts for the planner and preflight to agree on.
AGREEMENT_CASES = [
    ("llama-tiny", dict(dp_shard=2, tp=2), {}),
    ("llama-tiny", dict(tp=3), {}),  # tp not dividing the heads
    ("llama-tiny", dict(dp_shard=2, cp=2), {}),
    ("llama-tiny", dict(cp=4), dict(seq_len=252)),  # seq_len not divisible by 2 x cp
    ("llama-tiny", dict(pp=2, micro_batch=2), {}),
    ("llama-tiny", dict(pp=8, micro_batch=1), {}),  # more stages than layers
    ("qwen3moe-tiny", dict(dp_shard=4, ep=4), {}),
    ("qwen3moe-tiny", dict(dp_shard=8, ep=8), dict(global_batch=8)),  # ep not dividing the experts
    ("gemma2-tiny", dict(dp_shard=2), dict(attn_implementation="eager", mask_documents=False)),
    ("gemma2-tiny", dict(dp_shard=2), dict(attn_implementation="eager")),  # soft-capping with document masks
    ("gemma2-tiny", dict(dp_shard=2), dict(mask_documents=False)),  # sdpa for a family that cannot use it
    ("llama-tiny", dict(cp=2), dict(attn_implementation="eager")),  # eager with cp
    ("llama-tiny", dict(dp_shard=2), dict(attn_implementation="eager")),  # eager with document masks
    ("llama-tiny", dict(dp_shard=2), dict(attn_implementation="eager", mask_documents=False)),
]


def _agreement(preset, degrees, settings):
    """(the planner's verdict on the layout, preflight's verdict on its emitted config: None or the error)."""
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.errors import ConfigError
    from meshtron.plan.cli import resolve_model
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.report import train_config
    from meshtron.plan.search import _valid
    from meshtron.train.setup.preflight import preflight

    hf_config, model_cfg = resolve_model(preset)
    workload = Workload(**{"seq_len": 256, "global_batch": 16, **settings})
    micro = {k: v for k, v in degrees.items() if k == "micro_batch"}
    layout = Layout(ParallelDims(**{k: v for k, v in degrees.items() if k != "micro_batch"}), **micro)
    try:
        preflight(train_config(layout, workload, model_cfg), layout.dims.world_size, workload.device)
        refusal = None
    except ConfigError as err:
        refusal = str(err)
    return _valid(hf_config, layout, workload), refusal


@pytest.mark.parametrize("preset, degrees, settings", AGREEMENT_CASES)
def test_the_planner_proposes_a_layout_exactly_when_preflight_accepts_it(preset, degrees, settings):
    """The planner and ``meshtron train``'s preflight run one list of layout checks (``check_layout``): valid
    layouts pass both, and each kind of invalid one (tp, cp, ep, pp, attention) is refused by both."""
    valid, refusal = _agreement(preset, degrees, settings)
    assert valid == (refusal is None), refusal


def test_the_planner_refuses_eager_attention_with_document_masks_or_cp_as_preflight_does():
    """Meshtron's own attention (document masks, cp > 1) needs sdpa: a workload with another
    ``model.attn_implementation`` gets no such layout, and ``plan_layouts`` names preflight's fix."""
    from meshtron.errors import ConfigError
    from meshtron.plan.cli import resolve_model
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.search import candidate_layouts, plan_layouts

    for degrees, settings in [(dict(cp=2), {}), (dict(dp_shard=2), dict(mask_documents=True))]:
        valid, refusal = _agreement("llama-tiny", degrees, {"attn_implementation": "eager", **settings})
        assert not valid and "model.attn_implementation=eager cannot be combined with" in refusal
    hf_config, model_cfg = resolve_model("llama-tiny")
    shape = ModelShape.from_hf_config(hf_config, model_cfg)
    eager = Workload(seq_len=256, global_batch=16, mask_documents=False, attn_implementation="eager")
    layouts = candidate_layouts(shape, hf_config, eager, 4, hardware("h100"))
    assert layouts and {layout.dims.cp for layout in layouts} == {1}
    sdpa = candidate_layouts(shape, hf_config, Workload(seq_len=256, global_batch=16), 4, hardware("h100"))
    assert {layout.dims.cp for layout in sdpa} > {1}
    with pytest.raises(
        ConfigError, match="model.attn_implementation=eager cannot be combined with data.mask_documents"
    ):
        plan_layouts(shape, hf_config, Workload(256, 16, attn_implementation="eager"), 4, hardware("h100"))


def test_muon_holds_one_buffer_per_block_matrix_and_costs_its_gathers_and_iterations():
    """llama-1b on H100s, optimizer.name=muon: AdamW's two moments become one momentum buffer for the blocks'
    matrices (embeddings, head and norms keep two); the step adds Newton-Schulz on every block matrix, plus each
    sharded matrix's all-gather under FSDP / TP, nothing under AdamW."""
    from dataclasses import replace

    from meshtron.distributed.mesh import ParallelDims
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import estimate_memory, muon_numel, state_numel
    from meshtron.plan.throughput import estimate_step

    hf_config, shape = _llama_1b()
    hw = hardware("h100")
    adamw = Workload(seq_len=2048, global_batch=16)
    muon = replace(adamw, optimizer="muon")
    single = Layout(micro_batch=1)
    block_matrices = sum(math.prod(p.shape) for p in shape.block if len(p.shape) == 2) * shape.layers
    assert muon_numel(shape, single, muon) == [block_matrices] and muon_numel(shape, single, adamw) == [0]
    saved = estimate_memory(shape, single, adamw).optimizer - estimate_memory(shape, single, muon).optimizer
    assert saved == block_matrices * 4 and block_matrices < max(state_numel(shape, single, adamw))
    steps = {
        name: estimate_step(shape, layout, workload, hw, hf_config).optimizer_s
        for name, layout, workload in (
            ("adamw", single, adamw),
            ("muon", single, muon),
            ("muon-fsdp8", Layout(ParallelDims(dp_shard=8), micro_batch=1), muon),
            ("muon-tp8", Layout(ParallelDims(tp=8), micro_batch=1), muon),
        )
    }
    print("optimizer step:", {name: f"{seconds * 1e3:.1f} ms" for name, seconds in steps.items()})
    assert steps["adamw"] == 0 and 0 < steps["muon"] < steps["muon-fsdp8"] and steps["muon"] < steps["muon-tp8"]


def test_lora_plans_the_whole_model_but_gradients_and_adam_state_of_what_trains():
    """llama-1b with LoRA rank 16 on every projection: the parameters are the base's plus the adapters'; gradients
    and AdamW's moments are the adapters' only (2 x 4 bytes each in fp32), under one process and under TP4 (each
    adapter split like its projection: B of q_proj by rows, A of o_proj by columns)."""
    from meshtron.config import LoraConfig
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import estimate_memory, state_numel, trained_numel
    from meshtron.plan.model_shape import ModelShape

    hf_config = make_preset_config("llama-1b", 259)
    full = ModelShape.from_hf_config(hf_config)
    lora = ModelShape.from_hf_config(hf_config, lora=LoraConfig(rank=16))
    workload, single = Workload(seq_len=2048, global_batch=16), Layout(micro_batch=1)
    hidden, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    kv = hf_config.num_key_value_heads * (hidden // hf_config.num_attention_heads)
    per_block = 16 * ((hidden + hidden) * 2 + (hidden + kv) * 2 + 3 * (hidden + inter))  # q, o, k, v, gate/up/down
    assert trained_numel(lora, single, workload) == [per_block * layers]
    assert state_numel(lora, single, workload) == [state_numel(full, single, workload)[0] + per_block * layers]
    memory = estimate_memory(lora, single, workload)
    assert memory.grads == 4 * per_block * layers and memory.optimizer == 8 * per_block * layers
    specs = {spec.name: spec for spec in lora.block}
    assert specs["self_attn.q_proj.lora_B.weight"].tp_dim(4, 8) == 0
    assert specs["self_attn.q_proj.lora_A.weight"].tp_dim(4, 8) is None
    assert specs["self_attn.o_proj.lora_A.weight"].tp_dim(4, 8) == 1
    assert specs["self_attn.o_proj.lora_B.weight"].tp_dim(4, 8) is None
    tp4 = Layout(ParallelDims(tp=4), micro_batch=1)
    assert trained_numel(lora, tp4, workload)[0] < per_block * layers / 2


def test_plan_lora_rank_plans_and_emits_a_lora_run(tmp_path, capsys):
    """meshtron plan --lora-rank: the header says so, the best layout needs less memory and time per step than full
    training's, and the emitted config carries [lora]."""
    from meshtron.config import load_config

    args = ["--model", "llama-1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "16", "--json"]
    candidates = {}
    for rank in (0, 16):
        status, stdout, stderr = plan_cli(capsys, *args, "--lora-rank", str(rank))
        assert status == 0, stderr[-2000:]
        candidates[rank] = json.loads(stdout)["candidates"]
    best = candidates[0][0]
    same = next(c for c in candidates[16] if c["layout"] == best["layout"])
    assert same["memory_gb"]["total"] < best["memory_gb"]["total"] and same["step_s"] < best["step_s"]
    assert same["memory_gb"]["grads"] < best["memory_gb"]["grads"] / 10
    out = tmp_path / "lora.toml"
    status, stdout, stderr = plan_cli(capsys, *args[:-1], "--lora-rank", "16", "--emit-config", str(out))
    assert status == 0 and "LoRA rank 16" in stdout, stderr[-2000:]
    assert load_config(out, env={}).lora.rank == 16
    status, _, stderr = plan_cli(capsys, *args, "--lora-rank", "-1")
    assert status == 2 and "--lora-rank must be >= 0" in stderr


def test_the_planner_weighs_ulysses_against_ring_where_the_heads_allow_it():
    """Context-parallel candidates come with ring and Ulysses (parallel.cp_method) where the heads split over cp
    (llama-small's 6 heads: cp 2 only); Ulysses' four all-to-alls per pass are on the critical path, ring's K/V
    steps hide behind attention: at 128k tokens ring wins, at 8k over 16 GPUs (two nodes) Ulysses does."""
    from meshtron.config import ParallelOptions
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.search import candidate_layouts
    from meshtron.plan.throughput import estimate_step

    hw = hardware("h100")
    small = make_preset_config("llama-small", 259)
    workload = Workload(seq_len=8192, global_batch=8)
    methods = {
        (layout.dims.cp, layout.parallel.cp_method)
        for layout in candidate_layouts(ModelShape.from_hf_config(small), small, workload, 8, hw)
        if layout.dims.cp > 1
    }
    assert {(2, "ring"), (2, "ulysses"), (4, "ring")} <= methods and (4, "ulysses") not in methods

    big = make_preset_config("llama-8b", 128256)
    shape = ModelShape.from_hf_config(big)

    def seconds(seq_len: int, method: str) -> float:
        layout = Layout(ParallelDims(cp=16), micro_batch=1, parallel=ParallelOptions(cp_method=method))
        return estimate_step(shape, layout, Workload(seq_len=seq_len, global_batch=8), hw, big).seconds

    assert seconds(8192, "ulysses") < seconds(8192, "ring")
    assert seconds(131072, "ring") < seconds(131072, "ulysses")


def test_the_planner_proposes_hybrid_where_cp_spans_nodes():
    """parallel.cp_method=hybrid is a candidate where the cp ranks span nodes, with a node's cp ranks
    (gpus_per_node / tp) as its Ulysses groups, and passes the layout checks; its ends cost what ring (cp_ulysses 1)
    and Ulysses (cp_ulysses = cp) cost; over 4 nodes (cp 32) its all-to-all inside the node and ring of 4 across
    nodes beat Ulysses' all-to-all and ring's 31 steps across nodes at 32k tokens; the table says hybrid:8."""
    from meshtron.config import ParallelOptions
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.report import describe_layout
    from meshtron.plan.search import candidate_layouts
    from meshtron.plan.throughput import estimate_step

    hw = hardware("h100")
    big = make_preset_config("llama-8b", 128256)
    shape = ModelShape.from_hf_config(big)
    workload = Workload(seq_len=32768, global_batch=8)
    hybrid = {
        (layout.dims.cp, layout.dims.tp, layout.parallel.cp_ulysses)
        for layout in candidate_layouts(shape, big, workload, 32, hw)
        if layout.parallel.cp_method == "hybrid"
    }
    assert {(16, 1, 8), (16, 2, 4), (8, 4, 2)} <= hybrid
    assert all(cp > ulysses == hw.gpus_per_node // tp for cp, tp, ulysses in hybrid)

    def step(method: str, ulysses: int = 0, cp: int = 32, seq_len: int = 32768):
        layout = Layout(
            ParallelDims(cp=cp), micro_batch=1, parallel=ParallelOptions(cp_method=method, cp_ulysses=ulysses)
        )
        layout.check(big, Workload(seq_len=seq_len, global_batch=8))
        return estimate_step(shape, layout, Workload(seq_len=seq_len, global_batch=8), hw, big)

    assert step("hybrid", 1).seconds == pytest.approx(step("ring").seconds)
    assert step("hybrid", 32).seconds == pytest.approx(step("ulysses").seconds)
    assert step("hybrid", 8).exposed_comm_s < min(step("ring").exposed_comm_s, step("ulysses").exposed_comm_s)
    layout = Layout(ParallelDims(cp=32), micro_batch=1, parallel=ParallelOptions(cp_method="hybrid", cp_ulysses=8))
    assert describe_layout(layout).startswith("cp=32 (hybrid:8)")
    assert layout.parallel_config().cp_ulysses == 8


def _table_rows(stdout: str) -> list[list[str]]:
    """The table's rows as [degrees, micro, ckpt, cp method, schedule] (the numbers left out)."""
    rows = []
    for line in stdout.splitlines():
        cells = line.split("|")
        if len(cells) == 4 and cells[0][:1] in ("*", " ") and cells[0].split()[-1].isdigit():
            rows.append([" ".join(cells[0].strip(" *").split()), *cells[1].split()])
    return rows


def test_the_table_and_json_name_each_rows_cp_method(capsys):
    """Two layouts that differ only in parallel.cp_method (ring, Ulysses) are two rows told apart by the cp method
    column (before it they looked identical with different times); it says "-" where cp is 1, and --json's
    cp_method (null where cp is 1) lists the same rows."""
    args = ["--model", "llama-small", "--gpus", "8", "--seq-len", "4096", "--global-batch", "8", "--top", "100000"]
    status, stdout, stderr = plan_cli(capsys, *args)
    assert status == 0, stderr[-2000:]
    rows = _table_rows(stdout)
    methods: dict[tuple, set] = {}
    for degrees, micro, ckpt, method, schedule in rows:
        cp = int(degrees.split()[3])
        assert method == "-" if cp == 1 else method in ("ring", "allgather", "ulysses")
        methods.setdefault((degrees, micro, ckpt, schedule), set()).add(method)
    assert any(found == {"ring", "ulysses"} for found in methods.values()), "no ring / Ulysses pair in the table"
    status, stdout, _ = plan_cli(capsys, *args, "--json")
    fitting = [c for c in json.loads(stdout)["candidates"] if c["fits"]]
    assert len(fitting) == len(rows)
    for c in fitting:
        layout = c["layout"]
        assert c["cp_method"] == (layout["cp_method"] if layout["cp"] > 1 else None)
    assert sorted(c["cp_method"] or "-" for c in fitting) == sorted(row[3] for row in rows)


@pytest.mark.parametrize(
    "memory, note",
    [
        ("80GB", None),  # a plain layout fits: nothing to explain
        ("44GB", "none"),  # only checkpointed layouts fit: selective is the best
        ("40GB", "selective"),  # only full checkpointing fits
    ],
)
def test_a_checkpointing_recommendation_says_why_when_no_plain_layout_fits(capsys, memory, note):
    """llama-1b on one GPU at seq 8192, eager blocks: with 80 GB a plain layout fits (no note); with 44 GB none does
    and the line under the table names the smallest plain layout and its GB (the same figure as --json's); with
    40 GB selective checkpointing does not fit either and the line says so too."""
    # eager blocks: compiled ones keep about what selective checkpointing keeps, which then saves little
    args = ["--model", "llama-1b", "--gpus", "1", "--seq-len", "8192", "--global-batch", "8", "--gpu-memory", memory]
    args.append("--no-compile")
    status, stdout, stderr = plan_cli(capsys, *args, "--top", "1")
    assert status == 0, stderr[-2000:]
    _, as_json, _ = plan_cli(capsys, *args, "--json")
    candidates = json.loads(as_json)["candidates"]
    best = candidates[0]["layout"]["activation_checkpointing"]

    def smallest(mode: str) -> str:
        tried = [c["memory_gb"]["total"] for c in candidates if c["layout"]["activation_checkpointing"] == mode]
        return f"{min(tried):.1f} GB"

    plain = "no layout fits without activation checkpointing: the smallest plain one (single process, micro batch 1)"
    either = "none fits with selective checkpointing either"
    if note is None:
        assert best == "none" and "activation checkpointing" not in stdout
        return
    assert best == {"none": "selective", "selective": "full"}[note]
    assert f"{plain} needs {smallest('none')} of the {int(memory[:2]) - 3} GB usable per GPU" in stdout
    assert (f"{either}: the smallest (single process, micro batch 1) needs {smallest('selective')}" in stdout) == (
        note == "selective"
    )


def test_an_emitted_config_dry_runs_without_nproc(tmp_path, capsys):
    """The emitted config holds every degree (dp_shard included), so ``meshtron train --dry-run --config`` takes the
    world size from their product: the same rank, layout and bytes as with --nproc; the line that reports the
    written file spells both commands with meshtron_command(). A config whose dp_shard is -1 still needs --nproc."""
    import re

    from conftest import run_main

    from meshtron.command import meshtron_command

    out = tmp_path / "plan.toml"
    status, stdout, stderr = plan_cli(
        capsys,
        "--model",
        "llama-tiny",
        "--gpus",
        "4",
        "--seq-len",
        "256",
        "--global-batch",
        "8",
        "--emit-config",
        str(out),
    )
    assert status == 0, stderr[-2000:]
    train = f"{meshtron_command()} train --config {out}"
    assert f"check a rank's memory with: {train} --dry-run;" in stdout
    assert f"run it with: {train} --nproc 4" in stdout

    def dry_run(*extra: str) -> str:
        done = run_main(["train", "--dry-run", "--config", str(out), *extra])
        assert done.returncode == 0, done.stderr[-2000:]
        return re.sub(r"\(\d+\.\d s\)", "(time)", done.stdout)

    alone = dry_run()
    assert "rank 0 of 4 " in alone and alone == dry_run("--nproc", "4")
    done = run_main(["train", "--dry-run", "--config", str(out), "--parallel.dp_shard=-1"])
    assert done.returncode == 2 and "--dry-run needs --nproc N" in done.stderr


def test_plan_defaults_seq_len_and_global_batch_and_shows_them(capsys):
    """Without --seq-len and --global-batch: seq 4096 capped at the model's max_position_embeddings (qwen3-tiny:
    2048) and about 2**20 tokens per step rounded to a multiple of --gpus (512 sequences of 2048 over 24 GPUs: 21
    per GPU, 504), both marked (default) in the header and planned (--json's workload); given ones are not marked."""
    from meshtron.models.presets import make_preset_config

    max_positions = make_preset_config("qwen3-tiny", 259).max_position_embeddings
    seq_len = min(4096, max_positions)
    batch = round(2**20 / seq_len / 24) * 24
    assert (seq_len, batch) == (2048, 504)
    status, stdout, stderr = plan_cli(capsys, "--model", "qwen3-tiny", "--gpus", "24", "--top", "1")
    assert status == 0, stderr[-2000:]
    assert f"seq {seq_len} (default) x global batch {batch} (default) = {seq_len * batch:,} tokens per step" in stdout
    status, stdout, _ = plan_cli(capsys, "--model", "qwen3-tiny", "--gpus", "24", "--json")
    workload = json.loads(stdout)["workload"]
    assert (workload["seq_len"], workload["global_batch"]) == (seq_len, batch)
    status, stdout, _ = plan_cli(capsys, "--model", "llama-tiny", "--gpus", "4", "--global-batch", "8", "--top", "1")
    assert status == 0 and "seq 4096 (default) x global batch 8 = 32,768 tokens per step" in stdout


def test_the_planner_costs_an_optimizer_from_its_registry_entry(monkeypatch):
    """Workload.from_config carries the optimizer's own settings (optimizer.muon.ns_steps), which the step estimate
    uses; the memory estimate takes the state copies from the registry entry, not from a branch on a name."""
    from dataclasses import replace

    from meshtron.config import load_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import estimate_memory
    from meshtron.plan.throughput import matrix_step_s
    from meshtron.train.optim import registry

    hf_config, shape = _llama_1b()
    single, hw = Layout(micro_batch=1), hardware("h100")
    five, ten = (
        Workload.from_config(load_config(None, ["optimizer.name=muon", f"optimizer.muon.ns_steps={n}"], env={}))
        for n in (5, 10)
    )
    assert ten.optimizer_settings.ns_steps == 10
    assert matrix_step_s(shape, single, ten, hw) == pytest.approx(2 * matrix_step_s(shape, single, five, hw))
    adamw = Workload(seq_len=2048, global_batch=16)
    one_copy = replace(registry.OPTIMIZERS["adamw"], state_copies=1)
    monkeypatch.setitem(registry.OPTIMIZERS, "one-copy", one_copy)
    two, one = (estimate_memory(shape, single, w).optimizer for w in (adamw, replace(adamw, optimizer="one-copy")))
    assert two == 2 * one > 0


# ------------------------------------------------------------------------------------------- preference objectives


def _pairs_config(tmp_path, *overrides: str):
    """llama-deep, 8 pairs (or sequences) of 64 tokens a step, one process on CPU."""
    from preference_fixture import write_preference_jsonl

    from meshtron.config import load_config

    pairs = tmp_path / "pairs.jsonl"
    if not pairs.exists():
        write_preference_jsonl(pairs, 16, "alphabet")
    settings = ["model.preset=llama-deep", "data.seq_len=64", "train.steps=2", "train.global_batch_size=8"]
    settings += ["run.progress=false", f"run.output_dir={tmp_path / overrides[0].replace('=', '-')}"]
    if any(o.startswith("train.objective") for o in overrides):
        settings += ["data.format=preference", f"data.path={pairs}"]
    return load_config(None, settings + list(overrides), env={})


def test_planned_preference_memory_matches_a_cpu_run(tmp_path, cache_dir):
    """DPO with a live reference (a frozen copy) and the same model as causal LM, one process on CPU: the planner's
    reference bytes are the reference's own parameters, and its activations (a pair a row: nothing doubles; the
    per-token log-probability head keeps the head's input, no fused-loss gradient) within 10% of what autograd
    kept, as for causal LM."""
    import torch

    import meshtron.train.trainer as trainer
    from meshtron.distributed.runtime import Runtime
    from meshtron.plan.memory import activation_bytes, config_view, estimate_memory

    cpu = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    causal = _pairs_config(tmp_path, "data.max_documents=40", f"data.cache_dir={cache_dir}")
    dpo = _pairs_config(tmp_path, "train.objective=dpo", "preference.reference=model")
    for cfg in (causal, dpo):
        result = trainer.train(cfg, cpu)
        shape, layout, workload = config_view(cfg, 1, device="cpu")
        planned = max(activation_bytes(shape, layout, workload))
        measured = result.activation_bytes
        print(f"{cfg.train.objective}: activations measured {measured:,} B, planned {planned:,.0f} B")
        assert abs(planned / measured - 1) <= 0.10
        memory = estimate_memory(shape, layout, workload)
        assert result.reference_bytes == memory.reference
    assert result.reference_bytes > 0 and workload.reference == "model"
    assert memory.reference == memory.params  # the same parameters in the same dtype, no LoRA


def test_the_planner_counts_each_reference_and_its_forward():
    """A frozen-copy reference adds its parameters (in reference_dtype, sharded like the policy) and no gradients or
    optimizer state; lora_base and precomputed add no bytes; a live reference's forward adds its FLOPs."""
    import dataclasses

    from meshtron.config import LoraConfig
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.errors import ConfigError
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import estimate_memory
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.throughput import estimate_step

    hf_config, shape = _llama_1b()
    causal = Workload(2048, 16)
    layouts = [Layout(ParallelDims(dp_shard=8)), Layout(ParallelDims(dp_shard=2, tp=2, pp=2), micro_batch=1)]
    for layout in layouts:
        base = estimate_memory(shape, layout, causal)
        model = estimate_memory(shape, layout, dataclasses.replace(causal, objective="dpo", reference="model"))
        assert model.reference == base.params and model.state == base.state
        half = dataclasses.replace(causal, objective="dpo", reference="model", reference_dtype="bfloat16")
        assert estimate_memory(shape, layout, half).reference == base.params // 2
        for objective, reference in (("dpo", "precomputed"), ("simpo", "none"), ("orpo", "none")):
            other = estimate_memory(
                shape, layout, dataclasses.replace(causal, objective=objective, reference=reference)
            )
            assert other.reference == other.reference_forward == 0
        assert model.total > base.total and model.reference_forward > 0
    lora = ModelShape.from_hf_config(hf_config, None, LoraConfig(rank=8, alpha=16))
    lora_base = dataclasses.replace(causal, objective="dpo", reference="lora_base")
    assert estimate_memory(lora, layouts[0], lora_base).reference == 0
    hw = hardware("h100")
    seconds = {
        reference: estimate_step(
            shape, layouts[0], dataclasses.replace(causal, objective="dpo", reference=reference), hw, hf_config
        ).seconds
        for reference in ("model", "precomputed")
    }
    plain = estimate_step(shape, layouts[0], causal, hw, hf_config).seconds
    assert plain < seconds["precomputed"] < seconds["model"] < 1.5 * seconds["precomputed"]
    for bad in (dict(objective="dpo"), dict(objective="simpo", reference="model"), dict(reference="model")):
        with pytest.raises(ConfigError, match="reference"):
            dataclasses.replace(causal, **bad)


def test_plan_objective_flags_and_the_emitted_config(tmp_path, capsys):
    """``meshtron plan --objective dpo``: the reference in the first line and the JSON, refused where the objective
    takes none; the emitted config trains DPO on preference data with its reference."""
    from meshtron.config import load_config
    from meshtron.plan.layout import Workload

    args = ["--model", "llama-1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "16"]
    code, out, _ = plan_cli(capsys, *args, "--objective", "dpo", "--reference-dtype", "bfloat16", "--json")
    best = json.loads(out)["candidates"][0]["memory_gb"]
    assert code == 0 and best["reference"] > 0
    code, out, _ = plan_cli(capsys, *args, "--objective", "orpo")
    assert code == 0 and "ORPO on pairs (one a row), reference: none" in out
    assert "takes no reference" in plan_cli(capsys, *args, "--objective", "simpo", "--reference", "model")[2]
    assert "add --lora-rank" in plan_cli(capsys, *args, "--objective", "dpo", "--reference", "lora_base")[2]
    emitted = tmp_path / "dpo.toml"
    code, out, _ = plan_cli(
        capsys, *args, "--objective", "ipo", "--reference", "precomputed", "--emit-config", str(emitted)
    )
    assert code == 0 and "--objective ipo --reference precomputed" in emitted.read_text()
    cfg = load_config(str(emitted), ["data.path=pairs.jsonl"], env={})
    assert (cfg.train.objective, cfg.data.format, cfg.preference.reference) == ("ipo", "preference", "precomputed")
    assert Workload.from_config(cfg).reference == "precomputed"
