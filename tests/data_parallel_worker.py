"""Two-rank checks of the data-parallel step helpers, in one torchrun launch of 2 processes (gloo).

Usage: torchrun --nproc-per-node 2 tests/data_parallel_worker.py OUT.json
Rank 0 writes {check: [got, want]} for: the gradient norm of whole (replicated) gradients, which needs
no collective; the fused loss + gradient-norm all-reduce over sharded DTensor gradients, with one loss
per rank and with a loss both ranks hold (loss_copies=2); which meshes and models
``replicates_only`` sends to DDP; and each label's log-probability under a vocabulary-sharded head
(meshtron.train.loss.token_logps), values and gradients, against one process's.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshtron.distributed.data_parallel import replicates_only
from meshtron.distributed.grad_norm import global_grad_norm
from meshtron.train.loss.token_logps import head_token_logps
from meshtron.train.step_stats import global_loss_and_grad_norm


def full_gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 4, generator=generator), torch.randn(6, generator=generator)]


def with_grads(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = []
    for grad in grads:
        param = nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append(param)
    return params


def token_logps_under_tensor_parallelism(mesh) -> dict[str, list[bool]]:
    """head_token_logps with the head weight and bias split over the vocabulary (37 rows: 19 and 18, chunks of 5
    tokens over 33), with whole hidden states and with sequence-parallel ones (11 positions: 6 and 5), equal to the
    same call on whole tensors: values, hidden-state and head gradients."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 8, generator=generator)
    weight, bias = torch.randn(37, 8, generator=generator) * 0.3, torch.randn(37, generator=generator) * 0.1
    labels = torch.randint(0, 37, (3, 11), generator=generator)
    labels[0, :4] = -100
    upstream = torch.randn(33, generator=generator)
    results = {}
    for layout in ("one process", "tp", "tp with sequence parallelism"):
        w, b = (
            t.clone() if layout == "one process" else distribute_tensor(t, mesh, [Shard(0)]) for t in (weight, bias)
        )
        h = distribute_tensor(hidden, mesh, [Shard(1)]) if layout.endswith("parallelism") else hidden.clone()
        h, w, b = (t.requires_grad_() for t in (h, w, b))
        logps = head_token_logps(h, labels, w, b, chunk_size=5, softcap=4.0)
        (logps * upstream).sum().backward()
        results[layout] = [
            logps.detach(),
            *(t.grad.full_tensor() if isinstance(t.grad, DTensor) else t.grad for t in (h, w, b)),
        ]
    names = ("token logps", "token logps hidden grad", "token logps weight grad", "token logps bias grad")
    return {
        f"{name} under {layout}": [torch.allclose(got, want, rtol=1e-5, atol=1e-6), True]
        for layout in ("tp", "tp with sequence parallelism")
        for name, got, want in zip(names, results[layout], results["one process"])
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    grads = full_gradients()
    want_norm = float(torch.cat([g.flatten() for g in grads]).norm())
    checks = {}

    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    checks["replicated norm"] = [float(global_grad_norm(with_grads(grads))), want_norm]
    dist.all_reduce = original
    checks["replicated norm collectives"] = [len(calls), 0]

    mesh = init_device_mesh("cpu", (2,))
    sharded = with_grads([distribute_tensor(g, mesh, [Shard(0)]) for g in grads])
    rank_losses = [3.0, 5.0]
    loss, norm = global_loss_and_grad_norm(torch.tensor(rank_losses[rank]), sharded, 16)
    checks["sharded norm"] = [float(norm), want_norm]
    checks["loss per rank"] = [float(loss), sum(rank_losses) / 16]
    loss, _ = global_loss_and_grad_norm(torch.tensor(7.0), sharded, 4, loss_copies=2)
    checks["loss held by both ranks"] = [float(loss), 7.0 / 4]

    model = nn.Linear(4, 4)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    replicate_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    shard_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    checks["ddp for pure replication"] = [replicates_only(model, replicate_mesh, fp32, False, False), True]
    checks["fsdp when sharding"] = [replicates_only(model, shard_mesh, fp32, False, False), False]
    checks["fsdp for mixed precision"] = [replicates_only(model, replicate_mesh, bf16, False, False), False]
    checks["fsdp for cpu offload"] = [replicates_only(model, replicate_mesh, fp32, True, False), False]
    checks["fsdp for pipeline stages"] = [replicates_only(model, replicate_mesh, fp32, False, True), False]
    tp_model = nn.Linear(4, 4)
    tp_model.weight = nn.Parameter(distribute_tensor(tp_model.weight.detach(), mesh, [Shard(0)]))
    checks["fsdp for dtensor parameters"] = [replicates_only(tp_model, replicate_mesh, fp32, False, False), False]

    checks.update(token_logps_under_tensor_parallelism(mesh))

    if rank == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(checks, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
