"""The data-parallel step's helpers: the local global-target count, the fused loss + gradient-norm
all-reduce, the collective-free norm of replicated gradients, DDP for pure replication, fused AdamW."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_forked
from torch import nn

from meshtron.config import OptimizerConfig
from meshtron.data.dataset import PackedDataset
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.distributed.grad_norm import global_grad_norm
from meshtron.train.loss.head import IGNORE_INDEX
from meshtron.train.optim.build import build_optimizer
from meshtron.train.step_stats import global_loss_and_grad_norm, global_target_count, host_values


def test_global_target_count_is_the_sum_of_every_ranks_own_count():
    sequences = np.arange(40 * 9, dtype=np.int32).reshape(40, 9) % 50
    sequences[3, 4:] = IGNORE_INDEX  # unlabelled tokens (sequence 3 appears in some global batches)
    sequences[17, 1:] = IGNORE_INDEX
    dataset = PackedDataset(sequences)
    schedule = GlobalBatchSchedule(len(dataset), 8, shuffle=True, seed=3)
    counts = set()
    for step in range(12):  # 96 positions over 40 sequences: crosses epochs
        per_rank = []
        for rank in range(4):
            for micro in schedule.local_micro_batches(step, rank, 4, 1):
                _, labels = dataset.batch(micro)
                per_rank.append(int((labels != IGNORE_INDEX).sum()))
        count = global_target_count(dataset, schedule.global_batch(step))
        assert isinstance(count, int) and count == max(1, sum(per_rank))
        counts.add(count)
    assert len(counts) > 1  # the unlabelled sequences were counted out somewhere


def test_global_target_count_is_at_least_one():
    dataset = PackedDataset(np.full((2, 5), IGNORE_INDEX, dtype=np.int32))
    assert global_target_count(dataset, np.array([0, 1])) == 1


def test_loss_and_norm_in_one_process():
    params = []
    for shape in ((5, 3), (7,)):
        param = nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape)
        params.append(param)
    loss, norm = global_loss_and_grad_norm(torch.tensor(12.0), params, 4)
    assert float(loss) == pytest.approx(3.0)
    assert float(norm) == pytest.approx(float(global_grad_norm(params)))
    assert host_values(loss, norm) == pytest.approx([3.0, float(norm)])


def test_two_ranks(tmp_path):
    """Replicated norm without a collective, fused loss + norm over DTensor shards, DDP or FSDP choice, per-token
    log-probabilities under a vocabulary-sharded head."""
    out = tmp_path / "checks.json"
    proc = run_forked(2, ["tests/data_parallel_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    checks = json.loads(out.read_text())
    assert len(checks) == 19
    for name, (got, want) in checks.items():
        assert got == pytest.approx(want, rel=1e-6), name


def test_adamw_is_fused_on_cpu_and_foreach_on_meta():
    cfg = OptimizerConfig()
    cpu = build_optimizer(nn.Linear(4, 4), cfg)
    assert all(group["fused"] and not group["foreach"] for group in cpu.param_groups)
    with torch.device("meta"):
        meta = build_optimizer(nn.Linear(4, 4), cfg)
    assert all(group["foreach"] and not group["fused"] for group in meta.param_groups)


def test_cpu_offload_is_checked_against_the_layout_before_any_collective():
    """fsdp.cpu_offload needs FSDP to offload through: FSDP over dp_shard x cp ranks, or over a one-rank mesh in a
    world of one (parity layout fsdp2_cpu_offload in test_parity.py trains the first against one process)."""
    from meshtron.config import load_config
    from meshtron.errors import ConfigError
    from meshtron.train.setup.preflight import preflight

    cfg = load_config(None, ["fsdp.cpu_offload=true", "run.progress=false"], env={})
    assert preflight(cfg, 2, "cpu").dims.fsdp_enabled
    preflight(cfg, 1, "cpu")  # one process: FSDP over a one-rank mesh
    cfg = load_config(None, ["fsdp.cpu_offload=true", "parallel.tp=2", "run.progress=false"], env={})
    with pytest.raises(ConfigError, match="fsdp.cpu_offload needs FSDP"):
        preflight(cfg, 2, "cpu")


def test_cpu_offload_in_one_process_shards_over_one_rank_and_trains_the_same_model(tmp_path, cache_dir):
    """One process with fsdp.cpu_offload: FSDP2 over a one-rank mesh with CPUOffloadPolicy (parameters, gradients
    and AdamW state in host memory on a GPU), the same losses as without. ``meshtron train`` starts such a run as one
    worker of its launcher, for the process group; here the test makes that group itself."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    def run(offload: bool):
        settings = [
            "model.preset=llama-tiny",
            "data.seq_len=32",
            "data.max_documents=40",
            f"data.cache_dir={cache_dir}",
            "train.steps=3",
            "train.global_batch_size=4",
            "run.progress=false",
            f"run.output_dir={tmp_path / str(offload)}",
            f"fsdp.cpu_offload={str(offload).lower()}",
        ]
        cfg = load_config(None, settings, env={})
        return train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))

    plain = run(False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        offloaded = run(True)
        weight = dict(offloaded.model.named_parameters())["model.embed_tokens.weight"]
        assert isinstance(weight, DTensor) and weight.device_mesh.size() == 1
        policy = offloaded.model._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy)
    finally:
        dist.destroy_process_group()
    assert offloaded.losses == pytest.approx(plain.losses, rel=1e-6), (offloaded.losses, plain.losses)
    assert offloaded.grad_norms == pytest.approx(plain.grad_norms, rel=1e-5)


def test_cpu_offload_on_gpus_adds_gloo_for_host_tensors():
    """Offloaded shards, gradients and AdamW state are CPU tensors: on GPUs the process group needs a
    CPU backend beside NCCL for any collective on them (this machine has no GPU to run it)."""
    from meshtron.distributed.runtime import process_group_backend

    assert process_group_backend("cuda", host_collectives=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cuda") == "nccl"
    assert process_group_backend("cpu", host_collectives=True) == "gloo"
