"""Checkpoints: exact resume under each parallelism, resume under another layout and world size,
a run killed mid-save, and export to a Hugging Face directory that plain transformers loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    assert_same_tensors,
    flip_a_byte,
    run_cli,
    run_layouts,
    run_main,
    run_torchrun,
    two_step_run,
    worker_env,
)

STEPS, HALF = 6, 3
LOSS_RTOL = 1e-5


def base(cache_dir) -> list[str]:
    return [
        "model.preset=llama-tiny",
        "data.max_documents=40",
        "data.seq_len=32",
        f"data.cache_dir={cache_dir}",
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "optimizer.lr=1e-3",
        "schedule.warmup_steps=2",
        "train.seed=7",
        "run.progress=false",
        f"checkpoint.interval={HALF}",
    ]


TIED = "model.preset=qwen3-tiny"  # tied embeddings
MIXTURE_DOCUMENTS = "mixture-documents.jsonl"


def mixture(cache_dir) -> str:
    """A weighted mixture (data.sources) of the stdlib sources and the lines of json/decoder.py."""
    return f"data.sources=builtin:python-stdlib:0.6,{cache_dir / MIXTURE_DOCUMENTS}:0.4"


def write_mixture_documents(cache_dir) -> None:
    import json.decoder

    lines = [line.strip() for line in Path(json.decoder.__file__).read_text().splitlines() if line.strip()]
    (cache_dir / MIXTURE_DOCUMENTS).write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))


def streamed(cache_dir) -> list[str]:
    """The lines of json/decoder.py streamed (data.streaming); data.max_documents=40 ends each pass after 40 lines."""
    return ["data.streaming=true", f"data.path={cache_dir / MIXTURE_DOCUMENTS}"]


MOE = "model.preset=qwen3moe-tiny"  # mixture of experts
LORA = ["lora.rank=4", "lora.train_head=true"]
BIAS = ["moe.router_balance=bias", "moe.router_bias_rate=0.01"]
DEEPSEEK = ["model.preset=deepseekv3-tiny", "moe.router_bias_rate=0.01"]  # balanced by its own router bias


def from_half(out: Path, name: str) -> str:
    return f"checkpoint.resume={out / name / 'checkpoints' / f'step-{HALF:08d}'}"


def in_process(name: str, overrides: list[str], out: Path, cache_dir):
    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    cfg = load_config(None, base(cache_dir) + overrides + [f"run.output_dir={out / name}"], env={})
    result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    weights = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    (out / f"{name}.json").write_text(json.dumps({"losses": result.losses}))
    torch.save(weights, out / f"{name}.pt")
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """Uninterrupted runs that save at step 3 and 6, and runs resumed from their step-3 checkpoint."""
    from test_parity import write_vocab_250_model

    out = tmp_path_factory.mktemp("checkpoint")
    write_mixture_documents(cache_dir)
    vocab_250_dir = write_vocab_250_model(cache_dir)
    vocab_250 = ["model.preset=none", f"model.name_or_path={vocab_250_dir}", f"data.tokenizer={vocab_250_dir}"]
    run_layouts(
        4,
        base(cache_dir),
        {
            "fsdp4": ["parallel.dp_shard=4"],
            "fsdp4_resumed": ["parallel.dp_shard=4", from_half(out, "fsdp4")],
            "dp2_tp2_from_fsdp4": ["parallel.dp_shard=2", "parallel.tp=2", from_half(out, "fsdp4")],
            "pp2_tp2": ["parallel.pp=2", "parallel.tp=2"],
            "pp2_tp2_resumed": ["parallel.pp=2", "parallel.tp=2", from_half(out, "pp2_tp2")],
            # train.on_nonfinite=rollback across ranks: step 5 made NaN, back to step 3 without batch 5.
            "pp2_tp2_rollback": [
                "parallel.pp=2",
                "parallel.tp=2",
                "train.on_nonfinite=rollback",
                "env:MESHTRON_FAULT=nan:step=5",
            ],
            "pp2_tp2_skip_batch_5": ["parallel.pp=2", "parallel.tp=2", "data.skip_batches=5"],
            # A mixture's order is a function of the seed, weights and step: FSDP4 -> DP2 x TP2 continues it.
            "fsdp4_mixture": [mixture(cache_dir), "parallel.dp_shard=4"],
            "dp2_tp2_mixture_from_fsdp4_mixture": [
                mixture(cache_dir),
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "fsdp4_mixture"),
            ],
            # A stream's position: each rank saves its lanes'; FSDP4 -> FSDP4 and -> DP2 x TP2 (other lane owners).
            "fsdp4_stream": [*streamed(cache_dir), "parallel.dp_shard=4"],
            "fsdp4_stream_resumed": [*streamed(cache_dir), "parallel.dp_shard=4", from_half(out, "fsdp4_stream")],
            "dp2_tp2_stream_from_fsdp4_stream": [
                *streamed(cache_dir),
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "fsdp4_stream"),
            ],
            # A rollback rewinds the lanes (the step read ahead included) to the checkpoint's position.
            "pp2_dp2_stream_rollback": [
                *streamed(cache_dir),
                "parallel.pp=2",
                "parallel.dp_shard=2",
                "train.on_nonfinite=rollback",
                "env:MESHTRON_FAULT=nan:step=5",
            ],
            "pp2_dp2_stream_skip_batch_5": [
                *streamed(cache_dir),
                "parallel.pp=2",
                "parallel.dp_shard=2",
                "data.skip_batches=5",
            ],
            "dp2_cp2_async": ["parallel.dp_shard=2", "parallel.cp=2", "checkpoint.async=true"],
            "dp2_cp2_async_resumed": ["parallel.dp_shard=2", "parallel.cp=2", from_half(out, "dp2_cp2_async")],
            "dp2_cp2_from_pp2_tp2": ["parallel.dp_shard=2", "parallel.cp=2", from_half(out, "pp2_tp2")],
            # Mixed precision: fp32 master weights on disk; fp16's loss scale (two overflows first) resumes too.
            "fsdp4_bf16": ["parallel.dp_shard=4", "precision.mixed_precision=bf16"],
            "fsdp4_bf16_resumed": [
                "parallel.dp_shard=4",
                "precision.mixed_precision=bf16",
                from_half(out, "fsdp4_bf16"),
            ],
            "fsdp4_fp16": [
                "parallel.dp_shard=4",
                "precision.mixed_precision=fp16",
                "precision.fp16_initial_loss_scale=262144",
                "precision.fp16_growth_interval=3",
            ],
            "fsdp4_fp16_resumed": [
                "parallel.dp_shard=4",
                "precision.mixed_precision=fp16",
                "precision.fp16_initial_loss_scale=262144",
                "precision.fp16_growth_interval=3",
                from_half(out, "fsdp4_fp16"),
            ],
            # Tied embeddings: under pp the last stage's head is a copy of the embeddings, saved under both model
            # names and with the embeddings' optimizer state; pp1 -> pp2, pp2 -> pp2 and pp2 -> FSDP (-> 1 below).
            "fsdp4_tied": [TIED, "parallel.dp_shard=4"],
            "pp2_dp2_tied": [TIED, "parallel.pp=2", "parallel.dp_shard=2"],
            "pp2_dp2_tied_resumed": [TIED, "parallel.pp=2", "parallel.dp_shard=2", from_half(out, "pp2_dp2_tied")],
            "pp2_dp2_tied_from_fsdp4_tied": [
                TIED,
                "parallel.pp=2",
                "parallel.dp_shard=2",
                from_half(out, "fsdp4_tied"),
            ],
            "fsdp4_tied_from_pp2_dp2_tied": [TIED, "parallel.dp_shard=4", from_half(out, "pp2_dp2_tied")],
            # Expert parallelism: experts sharded over ep (and FSDP over what remains); checkpoints hold whole experts.
            "ep2_fsdp4_moe": [MOE, "parallel.dp_shard=4", "parallel.ep=2"],
            "ep2_fsdp4_moe_resumed": [MOE, "parallel.dp_shard=4", "parallel.ep=2", from_half(out, "ep2_fsdp4_moe")],
            "ep4_moe_from_ep2_fsdp4_moe": [
                MOE,
                "parallel.dp_shard=4",
                "parallel.ep=4",
                from_half(out, "ep2_fsdp4_moe"),
            ],
            "fsdp4_moe_from_ep2_fsdp4_moe": [MOE, "parallel.dp_shard=4", from_half(out, "ep2_fsdp4_moe")],
            "ep2_pp2_moe_from_ep2_fsdp4_moe": [
                MOE,
                "parallel.pp=2",
                "parallel.dp_shard=2",
                "parallel.ep=2",
                from_half(out, "ep2_fsdp4_moe"),
            ],
            # Muon's momentum buffers are sharded like their parameters and resharded like AdamW's moments.
            "fsdp4_muon": ["optimizer.name=muon", "parallel.dp_shard=4"],
            "fsdp4_muon_resumed": ["optimizer.name=muon", "parallel.dp_shard=4", from_half(out, "fsdp4_muon")],
            "dp2_tp2_muon_from_fsdp4_muon": [
                "optimizer.name=muon",
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "fsdp4_muon"),
            ],
            # LoRA: checkpoints hold the adapters (and the trained head) only; the base is the seed's, as at the start.
            "fsdp4_lora": [*LORA, "parallel.dp_shard=4"],
            "fsdp4_lora_resumed": [*LORA, "parallel.dp_shard=4", from_half(out, "fsdp4_lora")],
            "dp2_tp2_lora_from_fsdp4_lora": [
                *LORA,
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "fsdp4_lora"),
            ],
            # LoRA on a mixture of experts: the experts' adapters sharded over ep, resumed without EP under TP.
            "ep2_fsdp4_moe_lora": [MOE, *LORA, "parallel.dp_shard=4", "parallel.ep=2"],
            "dp2_tp2_moe_lora_from_ep2_fsdp4_moe_lora": [
                MOE,
                *LORA,
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "ep2_fsdp4_moe_lora"),
            ],
            # Router balancing biases (moe.router_balance=bias) are model buffers: saved, and resumed exactly.
            "ep2_fsdp4_moe_bias": [MOE, *BIAS, "parallel.dp_shard=4", "parallel.ep=2"],
            "ep2_fsdp4_moe_bias_resumed": [
                MOE,
                *BIAS,
                "parallel.dp_shard=4",
                "parallel.ep=2",
                from_half(out, "ep2_fsdp4_moe_bias"),
            ],
            # DeepSeek-V3 (latent attention split by heads, router biases moved): EP2 x TP2 -> PP2 x DP2.
            "ep2_tp2_deepseek": [*DEEPSEEK, "parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2"],
            "pp2_dp2_deepseek_from_ep2_tp2_deepseek": [
                *DEEPSEEK,
                "parallel.pp=2",
                "parallel.dp_shard=2",
                from_half(out, "ep2_tp2_deepseek"),
            ],
            # Another data.seq_len: the rest of the epoch cut to 64 (meshtron.data.carry) is read under any layout.
            "dp2_tp2_seq64_from_fsdp4": [
                "data.seq_len=64",
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "fsdp4"),
            ],
            # A vocabulary of 250, which tp=4 does not divide (rows 63/63/63/61), resumed under dp=2 x tp=2 (125/125).
            "vocab250_tp4": [*vocab_250, "parallel.tp=4"],
            "vocab250_dp2_tp2_from_tp4": [
                *vocab_250,
                "parallel.dp_shard=2",
                "parallel.tp=2",
                from_half(out, "vocab250_tp4"),
            ],
        },
        out,
    )
    in_process("single", [], out, cache_dir)
    in_process("single_resumed", [from_half(out, "single")], out, cache_dir)
    in_process("single_from_fsdp4", [from_half(out, "fsdp4")], out, cache_dir)
    in_process("single_tied_from_pp2_dp2_tied", [TIED, from_half(out, "pp2_dp2_tied")], out, cache_dir)
    in_process("single_moe_from_ep2_fsdp4_moe", [MOE, from_half(out, "ep2_fsdp4_moe")], out, cache_dir)
    in_process("single_seq64_from_fsdp4", ["data.seq_len=64", from_half(out, "fsdp4")], out, cache_dir)
    return out


def losses(out: Path, name: str) -> list[float]:
    return json.loads((out / f"{name}.json").read_text())["losses"]


@pytest.mark.slow
def test_rollback_across_ranks_continues_as_a_run_that_skipped_the_batch(runs):
    """pp2 x tp2: the NaN step rolls every rank back to step 3; the trajectory and final weights are those of
    a run given data.skip_batches=[5] (test_faults.py has the one-process case and the limits)."""
    assert losses(runs, "pp2_tp2_rollback") == losses(runs, "pp2_tp2_skip_batch_5")
    assert losses(runs, "pp2_tp2_rollback")[:4] == losses(runs, "pp2_tp2")[:4]
    rolled, skipped = torch.load(runs / "pp2_tp2_rollback.pt"), torch.load(runs / "pp2_tp2_skip_batch_5.pt")
    assert rolled.keys() == skipped.keys() and all(torch.equal(rolled[k], skipped[k]) for k in skipped)
    rows = [json.loads(line) for line in (runs / "pp2_tp2_rollback" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 4, 5, 6] and rows[4]["rolled_back_to"] == 3


@pytest.mark.slow
def test_a_streamed_run_rolls_back_as_a_run_that_skipped_the_batch(runs):
    """pp2 x dp2 streaming: the rollback to step 3 rewinds the lanes (and drops the step read ahead), batch 5 is
    skipped, and the trajectory and weights are those of data.skip_batches=[5]."""
    assert losses(runs, "pp2_dp2_stream_rollback") == losses(runs, "pp2_dp2_stream_skip_batch_5")
    rolled, skipped = (
        torch.load(runs / "pp2_dp2_stream_rollback.pt"),
        torch.load(runs / "pp2_dp2_stream_skip_batch_5.pt"),
    )
    assert all(torch.equal(rolled[k], skipped[k]) for k in skipped)


@pytest.mark.slow
@pytest.mark.parametrize(
    "straight",
    [
        "single",
        "fsdp4",
        "fsdp4_stream",
        "pp2_tp2",
        "dp2_cp2_async",
        "fsdp4_bf16",
        "fsdp4_fp16",
        "pp2_dp2_tied",
        "ep2_fsdp4_moe",
        "fsdp4_muon",
        "fsdp4_lora",
        "ep2_fsdp4_moe_bias",
    ],
)
def test_resume_is_exact(runs, straight):
    """N steps, stop, resume for N more: the same losses and weights, bit for bit, as 2N straight."""
    full, resumed = losses(runs, straight), losses(runs, f"{straight}_resumed")
    assert len(full) == STEPS and len(resumed) == STEPS - HALF
    assert resumed == full[HALF:]
    weights, resumed_weights = torch.load(runs / f"{straight}.pt"), torch.load(runs / f"{straight}_resumed.pt")
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)


@pytest.mark.slow
@pytest.mark.parametrize(
    "resumed, straight",
    [
        ("dp2_tp2_from_fsdp4", "fsdp4"),  # FSDP4 -> DP2 x TP2, same world size
        ("single_from_fsdp4", "fsdp4"),  # 4 processes -> 1
        ("dp2_cp2_from_pp2_tp2", "pp2_tp2"),  # PP2 x TP2 -> DP2 x CP2
        ("dp2_tp2_mixture_from_fsdp4_mixture", "fsdp4_mixture"),  # a mixture of two sources: FSDP4 -> DP2 x TP2
        ("dp2_tp2_stream_from_fsdp4_stream", "fsdp4_stream"),  # a stream: 4 ranks' lanes -> 2 ranks'
        (
            "pp2_dp2_tied_from_fsdp4_tied",
            "fsdp4_tied",
        ),  # tied: FSDP4 -> PP2 x DP2 (the head copy gets the embeddings' moments)
        ("fsdp4_tied_from_pp2_dp2_tied", "pp2_dp2_tied"),  # tied: PP2 x DP2 -> FSDP4
        ("single_tied_from_pp2_dp2_tied", "pp2_dp2_tied"),  # tied: PP2 x DP2 -> 1 process
        ("ep4_moe_from_ep2_fsdp4_moe", "ep2_fsdp4_moe"),  # MoE: EP2 x FSDP4 -> EP4
        ("fsdp4_moe_from_ep2_fsdp4_moe", "ep2_fsdp4_moe"),  # MoE: EP2 x FSDP4 -> no EP
        ("ep2_pp2_moe_from_ep2_fsdp4_moe", "ep2_fsdp4_moe"),  # MoE: EP2 x FSDP4 -> EP2 x PP2
        ("single_moe_from_ep2_fsdp4_moe", "ep2_fsdp4_moe"),  # MoE: EP2 x FSDP4 -> 1 process
        ("dp2_tp2_muon_from_fsdp4_muon", "fsdp4_muon"),  # Muon's momentum: FSDP4 -> DP2 x TP2
        ("dp2_tp2_lora_from_fsdp4_lora", "fsdp4_lora"),  # LoRA adapters: FSDP4 -> DP2 x TP2
        ("dp2_tp2_moe_lora_from_ep2_fsdp4_moe_lora", "ep2_fsdp4_moe_lora"),  # expert adapters: EP2 -> TP2, no EP
        ("pp2_dp2_deepseek_from_ep2_tp2_deepseek", "ep2_tp2_deepseek"),  # DeepSeek-V3 and its router biases
    ],
)
def test_resume_under_another_layout_continues_the_run(runs, resumed, straight):
    full, continued = losses(runs, straight), losses(runs, resumed)
    assert len(continued) == STEPS - HALF
    for step, (got, want) in enumerate(zip(continued, full[HALF:]), start=HALF + 1):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: {got} vs uninterrupted {want}"


@pytest.mark.slow
def test_a_resume_with_another_seq_len_trains_the_same_under_another_layout(runs):
    """FSDP4's step-3 checkpoint resumed with data.seq_len=64 under DP2 x TP2 and in one process: the same losses
    (the carried sequences are a function of the checkpoint and the settings, not of the layout)."""
    single, layout = losses(runs, "single_seq64_from_fsdp4"), losses(runs, "dp2_tp2_seq64_from_fsdp4")
    assert len(single) == STEPS - HALF
    assert single != losses(runs, "single_from_fsdp4")  # other data than a resume at seq_len 32
    for step, (got, want) in enumerate(zip(layout, single), start=HALF + 1):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: {got} vs one process {want}"


@pytest.mark.slow
def test_a_lora_checkpoint_holds_only_what_trains(runs):
    """The adapters and the head (lora.train_head), with their AdamW moments: no frozen base weight is saved."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(runs / "fsdp4_lora" / "checkpoints" / f"step-{HALF:08d}")).read_metadata()
    model_keys = {key.removeprefix("model.") for key in keys.state_dict_metadata if key.startswith("model.")}
    assert model_keys and all(".lora_" in key or key == "lm_head.weight" for key in model_keys), sorted(model_keys)
    assert "lm_head.weight" in model_keys and not any(
        "exp_avg" in key and "q_proj.weight" in key for key in keys.state_dict_metadata
    )


@pytest.mark.slow
def test_damaged_latest_checkpoint_is_skipped_by_auto_and_refused_by_path(runs, tmp_path, cache_dir, capfd):
    """A truncated tensor file in the newest checkpoint: checkpoint.resume=auto says so, resumes from the one
    before and continues exactly; the same checkpoint given by path is a one-line error naming the file; with
    every checkpoint damaged, auto is an error too (nothing is silently started over)."""
    import shutil

    from meshtron.checkpoint.manager import find_checkpoint
    from meshtron.errors import MeshtronError

    checkpoints = tmp_path / "damaged" / "checkpoints"
    shutil.copytree(runs / "single" / "checkpoints", checkpoints)
    newest, previous = checkpoints / f"step-{STEPS:08d}", checkpoints / f"step-{HALF:08d}"
    shard = next(newest.glob("*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])  # a copy or a write cut short

    with pytest.raises(MeshtronError) as err:
        find_checkpoint(checkpoints, str(newest))
    message = str(err.value)
    assert f"{shard.name} has {size // 2:,} bytes, {size:,} when saved" in message and "\n" not in message

    in_process("damaged", [], tmp_path, cache_dir)
    log = capfd.readouterr()
    assert f"checkpoint {newest.name} is damaged ({shard.name} has" in log.out + log.err
    assert losses(tmp_path, "damaged") == losses(runs, "single")[HALF:]  # resumed at step 3, exactly
    assert damage_free(newest)  # the resumed run saved step 6 again, whole

    for folder in (newest, previous):
        (folder / ".metadata").write_bytes(b"")
    with pytest.raises(MeshtronError, match="no whole checkpoint to resume from"):
        find_checkpoint(checkpoints, "auto")


@pytest.mark.slow
def test_killed_ranks_restart_the_run_which_continues_exactly(runs, tmp_path, cache_dir):
    """pp2 x tp2 over 4 ranks (checkpoints at steps 3 and 6), `--max-restarts 1`: the last stage's second tensor-
    parallel rank SIGKILLed between the two checkpoints (step 5). The workers restart and resume from step 3 by
    themselves; the last metrics row of every step and the final checkpoint equal the uninterrupted run's, bit for
    bit. Kills before the first checkpoint, right after one and during a save are in test_recovery.py (2 ranks:
    each restart re-imports torch and transformers in every rank, ~8 s of CPU each)."""
    out = tmp_path / "restarted"
    args = [
        "train",
        "--nproc",
        "4",
        "--max-restarts",
        "1",
        *[f"--{item}" for item in base(cache_dir)],
        "--parallel.pp=2",
        "--parallel.tp=2",
        f"--run.output_dir={out}",
    ]
    proc = run_cli(args, env=worker_env(MESHTRON_FAULT="kill:step=5:rank=3"), timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    restarted = "restart 1 of this run after a failure: resumed from step-00000003 (step 3); 1 step(s)"
    assert restarted in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 4, 5, 6]
    assert [row.get("restart", 0) for row in rows] == [0, 0, 0, 0, 1, 1, 1]
    last = {row["step"]: row["loss"] for row in rows}
    assert [last[step] for step in range(1, STEPS + 1)] == losses(runs, "pp2_tp2")
    assert_same_tensors(
        out / f"checkpoints/step-{STEPS:08d}", runs / "pp2_tp2" / f"checkpoints/step-{STEPS:08d}", tmp_path
    )


def damage_free(path: Path) -> bool:
    from meshtron.checkpoint.integrity import damage

    return damage(path) is None


@pytest.mark.slow
def test_export_loads_in_plain_transformers(runs, tmp_path):
    """The exported directory, loaded by plain transformers in a fresh process, gives the logits of
    meshtron's model with the same trained weights."""
    from meshtron.config import load_config
    from meshtron.data.tokenizer import load_tokenizer
    from meshtron.distributed.context_parallel import register_attention
    from meshtron.models.build import build_meta_model, load_hf_config, materialize
    from meshtron.train.batch import SequenceSplit, sequence_inputs

    checkpoint = runs / "single" / "checkpoints" / f"step-{STEPS:08d}"
    exported, sharded = tmp_path / "hf", tmp_path / "hf-sharded"
    proc = run_main(["export", str(checkpoint), str(exported)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_main(["export", str(checkpoint), str(sharded), "--max-shard-size=200KB"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    refused = run_main(["export", str(checkpoint), str(exported)])  # never writes into a non-empty directory
    assert refused.returncode != 0 and "is not empty" in refused.stderr
    input_ids = torch.randint(1, 250, (2, 32), generator=torch.Generator().manual_seed(0))  # no EOS: one document
    torch.save(input_ids, tmp_path / "ids.pt")
    script = (
        "import torch; from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(exported)!r}).eval()\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r}, weights_only=True)\n"
        f"torch.save(model(ids).logits.detach(), {str(tmp_path / 'logits.pt')!r})\n"
        f"other = AutoModelForCausalLM.from_pretrained({str(sharded)!r}).eval()\n"
        "assert torch.equal(other(ids).logits, model(ids).logits)\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], env=worker_env(), capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]

    run_cfg = load_config(checkpoint / "config.toml", env={})
    tokenizer = load_tokenizer(run_cfg.data.tokenizer)
    model, adapter = build_meta_model(load_hf_config(run_cfg.model, tokenizer.vocab_size), run_cfg.model)
    materialize(model, adapter, torch.device("cpu"), seed=0)
    model.load_state_dict(torch.load(runs / "single.pt", weights_only=True))  # the run's final weights
    adapter.use_attention(model, register_attention())
    split = SequenceSplit(mask_documents=True, eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        ours = model.eval()(**sequence_inputs(input_ids, split)).logits
    theirs = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_tied_pipeline_checkpoint_keeps_one_weight_and_exports_a_tied_model(runs, tmp_path):
    """A tied model trained (and resumed) under pp: the last stage's head stays equal to the embeddings, the
    checkpoint's optimizer state names only the embeddings (as a run without pp does), and the export is the
    usual tied Hugging Face model with the run's final weights."""
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    for name in ("pp2_dp2_tied", "pp2_dp2_tied_resumed", "pp2_dp2_tied_from_fsdp4_tied"):
        final = torch.load(runs / f"{name}.pt", weights_only=True)
        assert torch.equal(final["model.embed_tokens.weight"], final["lm_head.weight"]), name
    checkpoint = runs / "pp2_dp2_tied" / "checkpoints" / f"step-{STEPS:08d}"
    keys = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    assert {"model.model.embed_tokens.weight", "model.lm_head.weight"} <= keys
    assert "optim.state.model.embed_tokens.weight.exp_avg" in keys
    assert not any(key.startswith("optim.") and "lm_head" in key for key in keys)
    final = torch.load(runs / "pp2_dp2_tied.pt", weights_only=True)
    exported = tmp_path / "hf-tied"
    proc = run_main(["export", str(checkpoint), str(exported)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items() if k in state) and set(final) <= set(state)


@pytest.mark.slow
def test_killed_during_save_resumes_from_the_last_complete_checkpoint(tmp_path, cache_dir):
    out = tmp_path / "run"
    args = [
        "train",
        *[f"--{o}" for o in base(cache_dir)],
        "--checkpoint.interval=1",
        "--train.steps=400",
        "--checkpoint.keep_last=2",
        f"--run.output_dir={out}",
        "--model.preset=llama-small",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtron", *args],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    checkpoints = out / "checkpoints"
    deadline, caught = time.time() + 240, False
    while time.time() < deadline and proc.poll() is None:
        partial = list(checkpoints.glob("*.partial")) if checkpoints.is_dir() else []
        if partial and (checkpoints / "latest").is_file():
            os.killpg(proc.pid, signal.SIGKILL)
            caught = True
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    assert caught, "the run finished or failed before a save could be interrupted"
    latest = (checkpoints / "latest").read_text().strip()
    saved_step = int(latest.split("-")[1])
    resumed = run_cli([*args, "--train.steps=" + str(saved_step + 2)], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / latest} (step {saved_step}" in resumed.stdout
    assert not list(checkpoints.glob("*.partial"))


@pytest.mark.slow
def test_mixed_precision_checkpoints_and_exports_hold_float32(runs, tmp_path):
    """bf16 compute, fp32 master weights: the checkpoint's tensors and the exported safetensors are float32."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    checkpoint = runs / "fsdp4_bf16" / "checkpoints" / f"step-{STEPS:08d}"
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    dtypes = {
        meta.properties.dtype
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model") and hasattr(meta, "properties")
    }
    assert dtypes == {torch.float32}, dtypes
    exported = tmp_path / "hf-bf16"
    proc = run_main(["export", str(checkpoint), str(exported)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for file in exported.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.float32}


NODE_WORKER = """import os, sys
os.chdir(os.path.join(sys.argv[1], "node" + os.environ["RANK"]))  # each rank on a disk of its own
from meshtron.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_checkpoint_dir_not_shared_by_all_ranks_is_refused_at_start(tmp_path, cache_dir):
    """Node-local disks, simulated by a relative checkpoint.dir and one working directory per rank: every rank
    stops at start-up with the same one line, instead of failing at the first save while the others wait."""
    worker = tmp_path / "node_worker.py"
    worker.write_text(NODE_WORKER)
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    args = [
        "train",
        "--model.preset=tiny",
        "--data.max_documents=30",
        "--data.seq_len=32",
        f"--data.cache_dir={cache_dir}",
        "--train.steps=2",
        "--train.global_batch_size=4",
        "--run.progress=false",
        "--parallel.dp_shard=2",
        f"--run.output_dir={tmp_path / 'run'}",
        "--checkpoint.interval=1",
        "--checkpoint.dir=checkpoints",
    ]
    proc = run_torchrun(2, [str(worker), str(tmp_path), *args], timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("meshtron: error")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "checkpoint directory 'checkpoints' is not shared by all ranks: rank 0" in errors[0]
    assert "the test files of rank 1 (on " in errors[0] and "set checkpoint.dir (or run.output_dir)" in errors[0]
    assert str(REPO / "meshtron") not in proc.stderr, proc.stderr[-3000:]  # no traceback from a worker
    assert [p.name for p in (tmp_path / "node0" / "checkpoints").iterdir()] == []  # the probe is cleaned up
    assert not (tmp_path / "node1" / "checkpoints").exists()
    assert not (tmp_path / "run" / "config.toml").exists()  # the same run.output_dir can be used again


def test_a_failed_write_during_a_save_is_one_clear_error(tmp_path, monkeypatch):
    """A rank that cannot write its part of a save reports it (on every rank) instead of crashing alone."""
    from meshtron.checkpoint import manager
    from meshtron.distributed.runtime import Runtime
    from meshtron.errors import MeshtronError

    saver = manager.CheckpointManager(tmp_path / "ckpt", 1, 2, False, Runtime(0, 0, 1, torch.device("cpu")))

    def unwritable(obj, path, *args, **kwargs):
        raise RuntimeError(f"Parent directory {Path(path).parent} does not exist.")

    monkeypatch.setattr(manager.torch, "save", unwritable)
    with pytest.raises(MeshtronError, match=r"checkpoint step-00000001.partial failed \(rank 0: Parent directory"):
        saver.save(1, None, {}, "")
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_an_async_save_commits_once_no_rank_still_writes_the_save_its_step_asked_about(tmp_path):
    """``unfinished()`` is this rank's flag for the step's all-reduce; ``commit_if_done`` commits when the sum over
    the ranks is 0, and only the save that the flag was asked about (a newer one waits for the next step's)."""
    from meshtron.checkpoint import manager
    from meshtron.distributed.runtime import Runtime

    class Future:
        def __init__(self, done: bool):
            self.finished = done

        def done(self) -> bool:
            return self.finished

    saver = manager.CheckpointManager(tmp_path / "ckpt", 1, 2, True, Runtime(0, 0, 1, torch.device("cpu")))
    committed = []
    saver.wait = lambda: committed.append(saver.pending[1]) or setattr(saver, "pending", None)
    assert saver.unfinished() == 0
    saver.commit_if_done(0)  # nothing in flight
    saver.pending = (Future(False), 4, None, {}, None)
    assert saver.unfinished() == 1
    saver.commit_if_done(1)
    saver.pending[0].finished = True
    assert saver.unfinished() == 0
    saver.commit_if_done(1)  # another rank still writes
    assert committed == []
    saver.commit_if_done(0)
    assert committed == [4]
    saver.pending = (Future(True), 5, None, {}, None)  # started after the step's flags were read
    saver.commit_if_done(0)
    assert committed == [4]
    saver.unfinished()
    saver.commit_if_done(0)
    assert committed == [4, 5]


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), OSError(28, "No space left on device")])
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_whole_and_loadable(tmp_path, monkeypatch, error):
    """Step 1 saves; step 2's tensor write fails (permission, full disk): one clear error, `latest` still names
    step 1, nothing of step 2 is taken as complete, and step 1 loads with its values."""
    import torch.distributed.checkpoint as dcp

    from meshtron.checkpoint import manager
    from meshtron.distributed.runtime import Runtime
    from meshtron.errors import MeshtronError

    class State:
        def __init__(self, value: float):
            self.weights = {"w": torch.full((4,), value)}

        def state_dict(self):
            return self.weights

    saver = manager.CheckpointManager(tmp_path / "ckpt", 1, 3, False, Runtime(0, 0, 1, torch.device("cpu")))
    saver.save(1, State(1.0), {"step": 1}, "")

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(manager.dcp, "save", failing)
    reason = rf"\[Errno {error.errno}\] {error.strerror}"
    with pytest.raises(
        MeshtronError,
        match=rf"saving checkpoint step-00000002.partial failed \({reason}\); free disk "
        r"space, make checkpoint.dir writable or change it",
    ):
        saver.save(2, State(2.0), {"step": 2}, "")
    directory = tmp_path / "ckpt"
    assert (directory / "latest").read_text() == "step-00000001" and not (directory / "step-00000002").exists()
    assert manager.find_checkpoint(directory, "auto") == directory / "step-00000001"
    assert damage_free(directory / "step-00000001")
    loaded = State(0.0)
    with manager.quiet_single_process():
        dcp.load(loaded.weights, checkpoint_id=str(directory / "step-00000001"), no_dist=True)
    assert torch.equal(loaded.weights["w"], torch.ones(4))


def test_export_never_takes_trust_remote_code_from_the_checkpoint(tmp_path, monkeypatch):
    """A checkpoint's config.toml cannot make export run a model's own code; only the caller
    (``meshtron export --trust-remote-code``) can."""
    import meshtron.data.tokenizer as tokenizer_module
    from meshtron.checkpoint.export import export_checkpoint
    from meshtron.checkpoint.manager import META

    checkpoint = tmp_path / "step-00000001"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(b"")
    (checkpoint / META).write_text("{}")
    (checkpoint / "config.toml").write_text("[model]\ntrust_remote_code = true\n")

    class Stop(Exception):
        pass

    seen = []

    def spy(spec, trust_remote_code=False, model_dir=None):
        seen.append(trust_remote_code)
        raise Stop

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", spy)
    for asked in (False, True):
        with pytest.raises(Stop):
            export_checkpoint(str(checkpoint), str(tmp_path / f"out-{asked}"), trust_remote_code=asked)
    assert seen == [False, True]


# ---------------------------------------------------------------- a vocabulary tp does not divide


@pytest.mark.slow
def test_uneven_vocab_resumes_under_another_tp_and_exports_its_true_vocab(runs, tmp_path):
    """A checkpoint of a model whose vocabulary (250) tp=4 does not divide holds the true vocabulary: it
    resumes under tp=2 with the uninterrupted run's losses, and exports to a directory whose config and
    weights have 250 rows, which plain transformers loads with the run's final weights."""
    from safetensors import safe_open

    full, continued = losses(runs, "vocab250_tp4"), losses(runs, "vocab250_dp2_tp2_from_tp4")
    assert len(full) == STEPS and len(continued) == STEPS - HALF
    for step, (got, want) in enumerate(zip(continued, full[HALF:]), start=HALF + 1):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: {got} vs uninterrupted {want}"

    checkpoint = runs / "vocab250_tp4" / "checkpoints" / f"step-{STEPS:08d}"
    exported = tmp_path / "hf"
    proc = run_main(["export", str(checkpoint), str(exported)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 250
    with safe_open(str(exported / "model.safetensors"), "pt") as handle:
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            assert tuple(handle.get_slice(key).get_shape()) == (250, 64)
    assert (exported / "tokenizer.json").is_file()
    final = torch.load(runs / "vocab250_tp4.pt", weights_only=True)  # the run's final weights, gathered
    torch.save(final, tmp_path / "final.pt")
    script = (
        "import torch; from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(exported)!r})\n"
        "assert model.get_input_embeddings().weight.shape[0] == 250 and model.lm_head.weight.shape[0] == 250\n"
        f"final = torch.load({str(tmp_path / 'final.pt')!r}, weights_only=True)\n"
        "state = model.state_dict()\n"
        "assert set(final) <= set(state), sorted(set(final) - set(state))\n"
        "assert all(torch.equal(state[k], v) for k, v in final.items())\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], env=worker_env(), capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]


def _save_and_check_as_rank(rank: int, directory: Path, store: Path, async_save: bool) -> None:
    """One of 2 forked ranks (gloo): save a checkpoint, check it whole, change a byte of the file rank 1 checks, check
    it again; what each rank read for checksums and what it found, in ``result-rank<r>.json``."""
    import torch.distributed as dist

    from meshtron.checkpoint import integrity, manager
    from meshtron.distributed.runtime import Runtime

    dist.init_process_group("gloo", store=dist.FileStore(str(store), 2), rank=rank, world_size=2)
    reads: list[str] = []
    checksum = integrity.file_checksum
    integrity.file_checksum = lambda file: reads.append(Path(file).name) or checksum(file)

    class State:  # each rank's own tensors, so that each writes a file of its own
        def state_dict(self):
            return {f"w{rank}": torch.arange(4096, dtype=torch.float32) + rank}

    runtime = Runtime(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    saver = manager.CheckpointManager(directory / "checkpoints", 1, 2, async_save, runtime)
    saver.save(1, State(), {"step": 1}, "[train]\n")
    saver.wait()
    path = directory / "checkpoints" / "step-00000001"
    saved, reads[:] = list(reads), []
    whole = integrity.content_damage(path, runtime)
    checked, reads[:] = list(reads), []
    if rank == 0:
        sizes = json.loads((path / "meshtron.json").read_text())["files"]
        target = integrity.share_of_files(sizes, 1, 2)[0]
        data = bytearray((path / target).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / target).write_bytes(bytes(data))
    dist.barrier()
    changed = integrity.content_damage(path, runtime)
    result = {"saved": saved, "checked": checked, "whole": whole, "changed": changed}
    (directory / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("async_save", [False, True])
def test_each_rank_checksums_the_files_it_wrote_and_its_share_of_a_resume(tmp_path, async_save):
    """2 ranks (gloo): at the save each rank checksums only the files it wrote (rank 0 also .metadata and
    config.toml), and meshtron.json records every file; at a resume each file is read by one rank only, and a byte
    changed in a file rank 1 reads is found by both ranks alike."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=_save_and_check_as_rank, args=(rank, tmp_path, tmp_path / "store", async_save))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    for process in ranks:
        if process.is_alive():  # its peer failed: it waits in a collective
            process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    results = [json.loads((tmp_path / f"result-rank{rank}.json").read_text()) for rank in range(2)]
    meta = json.loads((tmp_path / "checkpoints" / "step-00000001" / "meshtron.json").read_text())
    assert sorted(meta["crc32"]) == sorted(meta["files"])
    assert sorted(results[0]["saved"]) == [".metadata", "__0_0.distcp", "config.toml", "rng-rank0.pt"]
    assert sorted(results[1]["saved"]) == ["__1_0.distcp", "rng-rank1.pt"]
    assert sorted(results[0]["checked"] + results[1]["checked"]) == sorted(meta["files"])
    assert results[0]["whole"] is None and results[1]["whole"] is None
    assert results[0]["changed"] == results[1]["changed"]
    assert "was changed after the save" in results[0]["changed"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, cache_dir) -> tuple[Path, list[float]]:
    """A one-process run (two_step_run) that saves steps 1 and 2: its folder and losses."""
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    out = tmp_path_factory.mktemp("two-checkpoints")
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    result = train(two_step_run("model.preset=llama-tiny", out, cache_dir, "checkpoint.interval=1"), runtime)
    return out, result.losses


def test_a_checkpoint_changed_in_place_is_refused_by_path_and_skipped_by_auto(
    two_checkpoints, tmp_path, cache_dir, capfd
):
    """A byte of step 2's tensors changed in place (the size unchanged). Given by path it is one line naming it and
    the file (exit 1, no traceback); checkpoint.resume=auto says it skips it, resumes from step 1 and trains step 2
    again to the same loss. meshtron export refuses it too."""
    import shutil

    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    saved, first_losses = two_checkpoints
    shutil.copytree(saved / "run", tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    newest = checkpoints / "step-00000002"
    shard = next(newest.glob("*.distcp"))
    flip_a_byte(shard)

    args = [
        "train",
        "--model.preset=llama-tiny",
        "--data.seq_len=16",
        "--data.max_documents=20",
        f"--data.cache_dir={cache_dir}",
        "--train.steps=2",
        "--train.global_batch_size=2",
        "--run.progress=false",
        f"--run.output_dir={tmp_path / 'by-path'}",
        f"--checkpoint.resume={newest}",
    ]
    refused = run_main(args)
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stdout + refused.stderr, refused.stderr
    assert lines[0].startswith(f"meshtron: error: checkpoint '{newest}' is damaged: {shard.name} was changed after")

    capfd.readouterr()
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    again = train(two_step_run("model.preset=llama-tiny", tmp_path, cache_dir, "checkpoint.interval=1"), runtime)
    said = capfd.readouterr().out
    assert f"checkpoint {newest.name} is damaged ({shard.name} was changed after the save" in said, said
    assert f"resumed from {checkpoints / 'step-00000001'} (step 1" in said, said
    assert again.losses == first_losses[1:]

    flip_a_byte(shard)  # the resumed run saved step 2 again: change it once more
    exported = run_main(["export", str(newest), str(tmp_path / "export")])
    assert exported.returncode == 2 and "Traceback" not in exported.stderr, exported.stderr
    assert f"'{newest}' is not a whole meshtron checkpoint ({shard.name} was changed after" in exported.stderr
    assert not (tmp_path / "export").exists()


def test_export_never_overwrites_what_is_at_its_destination(two_checkpoints, tmp_path):
    """An existing file, a folder that is not empty, a path under a file: each one line (exit 2), left as it was."""
    checkpoint = two_checkpoints[0] / "run" / "checkpoints" / "step-00000001"
    (tmp_path / "file").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes").write_text("mine too")
    for target, said in (
        (tmp_path / "file", "is an existing file"),
        (tmp_path / "full", "is not empty"),
        (tmp_path / "file" / "model", f"cannot be made: '{tmp_path / 'file'}' is a file"),
    ):
        proc = run_main(["export", str(checkpoint), str(target)])
        assert proc.returncode == 2, proc.stderr
        expected = f"meshtron: error: export directory '{target}' {said}; choose a new directory (nothing was written)"
        assert proc.stderr == expected + "\n"
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "full" / "notes").read_text() == "mine too"
