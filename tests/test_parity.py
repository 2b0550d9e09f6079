"""The core guarantee: every data-parallel layout trains the same model as one process.

Per-step losses (12 steps, fp32, CPU) and final weights of DDP, FSDP, HSDP, gradient accumulation
and activation checkpointing are compared with a plain single-process run of the same config.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_torchrun

STEPS = 12
LOSS_RTOL = 1e-5
# Final weights: relative L2 error per tensor, and a bound on any single element. Adam divides by
# sqrt(v), so an element whose gradient is ~0 can move by a few 1e-6 under a different summation
# order; a real bug (wrong loss scale, missing reduction) moves whole tensors by orders more.
WEIGHT_REL_L2 = 1e-5
WEIGHT_MAX_ABS = 2e-5
# A key bias adds the same q.b_k to every score of a query, which softmax ignores: its true gradient
# is exactly 0, so what it receives is rounding noise that Adam turns into lr-sized steps. Those
# tensors can only be checked to have stayed within that noise bound (lr x steps).
ZERO_GRADIENT_SUFFIXES = ("self_attn.k_proj.bias",)
NOISE_BOUND = 3e-3 * STEPS


def base_overrides(cache_dir) -> list[str]:
    return [
        "model.preset=llama-tiny",
        "data.max_documents=40",
        "data.seq_len=32",
        f"data.cache_dir={cache_dir}",
        f"train.steps={STEPS}",
        "train.global_batch_size=8",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.seed=7",
        "run.progress=false",
    ]


# name -> (world size, overrides, reference model preset)
LAYOUTS = {
    "ddp2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], "llama-tiny"),
    "fsdp2": (2, ["parallel.dp_shard=2"], "llama-tiny"),
    "fsdp2_accum": (2, ["parallel.dp_shard=2", "train.micro_batch_size=1"], "llama-tiny"),
    "fsdp2_qwen2": (2, ["parallel.dp_shard=2", "model.preset=qwen2-tiny"], "qwen2-tiny"),
    "fsdp4": (4, ["parallel.dp_shard=4"], "llama-tiny"),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"], "llama-tiny"),
    "hsdp2x2_accum_ac": (
        4,
        ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.micro_batch_size=1",
         "train.activation_checkpointing=full"],
        "llama-tiny",
    ),
    "fsdp4_selective_ac": (4, ["parallel.dp_shard=4", "train.activation_checkpointing=selective",
                               "model.preset=qwen2-tiny"], "qwen2-tiny"),
}


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory, cache_dir):
    """Launch each world size once, running all of its layouts in the same processes."""
    out = tmp_path_factory.mktemp("parity")
    base = base_overrides(cache_dir)
    for world in sorted({world for world, _, _ in LAYOUTS.values()}):
        spec = {"base": base, "layouts": {n: o for n, (w, o, _) in LAYOUTS.items() if w == world}}
        spec_file = out / f"spec{world}.json"
        spec_file.write_text(json.dumps(spec))
        proc = run_torchrun(world, ["tests/parity_worker.py", str(spec_file), str(out)], timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache_dir):
    """Single-process runs, no process group at all, one per model preset."""
    from meshtron.config import load_config
    from meshtron.train.runtime import Runtime
    from meshtron.train.trainer import train

    out = tmp_path_factory.mktemp("reference")
    results = {}
    for preset in sorted({preset for _, _, preset in LAYOUTS.values()}):
        cfg = load_config(None, base_overrides(cache_dir) + [f"model.preset={preset}", f"run.output_dir={out / preset}"], env={})
        result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
        results[preset] = (result.losses, {k: v.detach().clone() for k, v in result.model.state_dict().items()})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, parity_runs, references):
    ref_losses, ref_weights = references[LAYOUTS[layout][2]]
    got = json.loads((parity_runs / f"{layout}.json").read_text())
    assert len(got["losses"]) == STEPS
    for step, (loss, ref) in enumerate(zip(got["losses"], ref_losses), start=1):
        assert abs(loss - ref) <= LOSS_RTOL * abs(ref), f"step {step}: {loss} vs single-process {ref}"
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the reference run did not learn; the comparison would be vacuous"
    weights = torch.load(parity_runs / f"{layout}.pt", weights_only=True)
    assert set(weights) == set(ref_weights)
    for name, ref in ref_weights.items():
        diff = (weights[name].float() - ref.float())
        if name.endswith(ZERO_GRADIENT_SUFFIXES):
            assert diff.abs().max().item() <= NOISE_BOUND, name
            continue
        rel_l2 = (diff.norm() / ref.float().norm()).item()
        assert rel_l2 <= WEIGHT_REL_L2, f"{name}: relative L2 error {rel_l2:.2e}"
        assert diff.abs().max().item() <= WEIGHT_MAX_ABS, f"{name}: max abs error {diff.abs().max().item():.2e}"
