"""Issue 43, findings 1 and 3 on one GPU: meshtron's start-up creates DTensor's RNG tracker without a collective (so
a pipeline stage cannot block in a broadcast before its sends), and a ``fsdp.cpu_offload`` build keeps every buffer on
the GPU. Run from the repository root: ``PYTHONPATH=$PWD python bench/one_gpu_checks/rng_and_offload.py``."""

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor import _random as dtensor_random

from meshtron.config import ModelConfig, ParallelConfig
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.rng import seed_parallel_rng
from meshtron.models.build import build_meta_model, materialize
from meshtron.models.presets import make_preset_config

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
meshes = ParallelDims.from_config(ParallelConfig(), 1).build_mesh("cuda")
broadcasts = []
broadcast = dist.broadcast


def counted_broadcast(*args, **kwargs):
    broadcasts.append(1)
    return broadcast(*args, **kwargs)


dist.broadcast = counted_broadcast
seed_parallel_rng(meshes, 0)
assert dtensor_random._rng_tracker is not None and not broadcasts
x = distribute_tensor(torch.ones(4, 64, device="cuda"), meshes.tp, [Replicate()])
torch.nn.functional.dropout(x, 0.5)
assert not broadcasts
print("1 rng tracker made at start-up, dropout broadcasts nothing: ok")

model, adapter = build_meta_model(make_preset_config("deepseekv3-tiny", 257), ModelConfig())
materialize(model, adapter, torch.device("cpu"), seed=0, buffer_device=torch.device("cuda", 0))
assert all(buffer.device.type == "cuda" for buffer in model.buffers())
assert all(param.device.type == "cpu" for param in model.parameters())
print("3 offload build: every buffer on cuda: ok")
dist.destroy_process_group()
