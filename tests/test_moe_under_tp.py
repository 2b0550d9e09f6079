"""A sparse MoE block under tensor parallelism (meshtron.distributed.tp_styles.ReplicatedBlockParallel) with
expert-parallel experts under their own FSDP (expert_parallel.shard_experts), in one gloo process: the experts'
gradients are FSDP's, reduced and divided, however many forwards ran while FSDP kept them gathered.

The 8-rank ``ep2_pp2_tp2`` layout of ``meshtron check`` found it: under pipelining FSDP keeps every block gathered
between microbatches, and the block's reparametrization put the experts' *sharded* parameter back after each
forward, so every microbatch after the first computed with it; with one rank per expert shard (efsdp = 1: same
shape, no error) its gradient then bypassed FSDP's division and the experts' gradients came out ~1.5-1.9x theirs
(a forward without backward, evaluation, did the same to the next step's first forward). One process reproduces
it: a forward with FSDP keeping the experts gathered, then the forward and backward that train.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from conftest import free_port

from meshtron.distributed.expert_parallel import apply_expert_parallel, shard_experts
from meshtron.distributed.mesh import ParallelDims, expert_meshes
from meshtron.distributed.tp_styles import ReplicatedBlockParallel
from meshtron.tensors import local_tensor

DIVIDE = 2.0
"""The experts' gradient divide factor: the dense one, dp_shard x cp = 2 in ep2_pp2_tp2 (efsdp = 1)."""


def qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
    return block


def test_experts_gathered_between_forwards_keep_fsdp_gradient_division():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    reference = qwen3_moe_block()
    hidden = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    (reference(hidden).float().pow(2).sum() / DIVIDE).backward()  # the loss that FSDP's division gives the experts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        meshes = ParallelDims().build_mesh("cpu")
        meshes = expert_meshes(meshes, 1)
        block = copy.deepcopy(reference)
        block.zero_grad(set_to_none=True)
        apply_expert_parallel(block.experts, meshes.ep)
        parallelize_module(block, meshes.tp, ReplicatedBlockParallel(sequence_parallel=False))
        # As under pipelining (and for the last block): FSDP keeps the parameters gathered after forward.
        shard_experts(block.experts, meshes.expert_fsdp, DIVIDE, reshard_after_forward=False)
        fully_shard(block, mesh=meshes.fsdp, reshard_after_forward=False)
        with torch.no_grad():
            block(hidden)  # e.g. evaluation, or the previous pipeline microbatch: the experts stay gathered
        block(hidden).float().pow(2).sum().backward()
        grads = {name: local_tensor(param.grad) for name, param in block.experts.named_parameters()}
    finally:
        dist.destroy_process_group()

    assert set(grads) == {"gate_up_proj", "down_proj"}
    for name, grad in grads.items():
        want = getattr(reference.experts, name).grad
        # Before the fix: the undivided gradient, DIVIDE x this one.
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"experts.{name}: {m}")
