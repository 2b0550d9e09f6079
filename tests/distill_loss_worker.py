"""Two-rank check of the distillation loss under tensor parallelism (meshtron.train.loss.distill), gloo.

Usage: python tests/fork_launch.py 2 tests/distill_loss_worker.py OUT.json
Both heads are split over a vocabulary of 29 rows (``Shard(0)``, 15 + 14), the student's and the teacher's hidden
states are sequence-parallel (``Shard(1)``); each divergence, unfused (gathered logits) and fused (chunks of 3 tokens,
which do not divide the 16), against one process's unfused loss on the whole tensors. Rank 0 writes, per case, the
largest difference of the loss, the sums and each gradient (this rank's half of the hidden states, the whole head).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshtron.data.labels import IGNORE_INDEX
from meshtron.train.loss.distill import DIVERGENCES, DistillOptions, distill_loss_sum

VOCAB, SIZE, TEACHER_SIZE, BATCH, SEQ = 29, 12, 10, 2, 8
SOFTCAPS = dict(softcap=6.0, teacher_softcap=7.0)


def inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, SIZE, generator=gen)
    weight = torch.randn(VOCAB, SIZE, generator=gen) * 0.5
    bias = torch.randn(VOCAB, generator=gen) * 0.2
    teacher_hidden = torch.randn(BATCH, SEQ, TEACHER_SIZE, generator=gen)
    teacher_weight = torch.randn(VOCAB, TEACHER_SIZE, generator=gen) * 0.5
    teacher_bias = torch.randn(VOCAB, generator=gen) * 0.2
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[1, :3] = IGNORE_INDEX
    return hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels


def one_process(options):
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels = inputs()
    params = [t.requires_grad_() for t in (hidden, weight, bias)]
    loss, sums = distill_loss_sum(
        hidden, teacher_hidden, labels, weight, bias, teacher_weight, teacher_bias, options, **SOFTCAPS
    )
    return loss, sums, torch.autograd.grad(loss, params)


def split(mesh, options, chunk_size):
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels = inputs()
    rank = dist.get_rank()
    local_hidden = hidden.chunk(2, dim=1)[rank].clone().requires_grad_()
    sharded_hidden = DTensor.from_local(local_hidden, mesh, [Shard(1)], run_check=False)
    teacher_sharded = DTensor.from_local(teacher_hidden.chunk(2, dim=1)[rank], mesh, [Shard(1)], run_check=False)
    w, b = (distribute_tensor(t, mesh, [Shard(0)]).requires_grad_() for t in (weight, bias))
    tw, tb = (distribute_tensor(t, mesh, [Shard(0)]) for t in (teacher_weight, teacher_bias))
    loss, sums = distill_loss_sum(
        sharded_hidden, teacher_sharded, labels, w, b, tw, tb, options, chunk_size=chunk_size, **SOFTCAPS
    )
    grad_hidden, grad_weight, grad_bias = torch.autograd.grad(loss, (local_hidden, w, b))
    return loss, sums, (grad_hidden, grad_weight.full_tensor(), grad_bias.full_tensor())


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    results = {}
    for divergence in DIVERGENCES:
        options = DistillOptions(divergence, beta=0.3, temperature=1.5, alpha=0.3)
        want_loss, want_sums, (want_hidden, want_weight, want_bias) = one_process(options)
        want_hidden = want_hidden.chunk(2, dim=1)[rank]
        for chunk_size in (0, 3):
            loss, sums, grads = split(mesh, options, chunk_size)
            pairs = {
                "loss": (loss, want_loss),
                "sums": (sums, want_sums),
                "hidden": (grads[0], want_hidden),
                "weight": (grads[1], want_weight),
                "bias": (grads[2], want_bias),
            }
            results[f"{divergence}/{chunk_size}"] = {
                name: (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
                for name, (got, want) in pairs.items()
            }
    if rank == 0:
        with open(sys.argv[1], "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
