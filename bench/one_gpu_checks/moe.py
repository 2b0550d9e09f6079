"""Issue 43, findings 7 and 8 on one GPU: the MoE combine is bitwise the same whatever the dispatch order (fp32 and
bf16) and the experts' forward and backward repeat bitwise; an expert-parallel forward makes one host sync; compiled
layers of a Qwen3-MoE do not recompile across steps. Falls back to CPU / gloo without a GPU. Run from the repository
root: ``PYTHONPATH=$PWD python bench/one_gpu_checks/moe.py``."""

import socket
import warnings

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from meshtron.distributed.expert_parallel import apply_expert_parallel
from meshtron.models.experts import combine, local_experts_forward
from meshtron.models.moe import moe_blocks
from meshtron.models.presets import make_preset_config

cuda = torch.cuda.is_available()
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
for dtype in (torch.float32, torch.bfloat16):  # 7: combine bitwise across orders and = reference
    g = torch.Generator(device=dev).manual_seed(0)
    T, k, H = 8192, 8, 2048
    pairs = torch.randn(T * k, H, device=dev, dtype=dtype, generator=g)
    w = torch.rand(T, k, device=dev, generator=g)
    ref = (pairs.view(T, k, H) * w.unsqueeze(-1)).to(dtype).sum(1)
    outs = []
    for seed in range(4):
        order = torch.randperm(T * k, device=dev, generator=torch.Generator(device=dev).manual_seed(seed))
        outs.append(combine(pairs[order], order, w, dtype))
    print(
        "7 combine",
        dtype,
        "bitwise across orders:",
        all(torch.equal(o, outs[0]) for o in outs),
        "= reference:",
        torch.equal(outs[0], ref),
    )
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(make_preset_config("qwen3moe-tiny", 257)).to(
    dev, torch.bfloat16 if cuda else torch.float32
)
experts = moe_blocks(model)[0][1].experts
Hd = experts.gate_up_proj.shape[-1]
x = torch.randn(4096, Hd, device=dev, dtype=experts.gate_up_proj.dtype, requires_grad=True)
idx = torch.randint(0, experts.gate_up_proj.shape[0], (4096, 2), device=dev)
wt = torch.rand(4096, 2, device=dev, requires_grad=True)
runs = []
for _ in range(2):
    out = local_experts_forward(experts, x, idx, wt)
    runs.append([out, *torch.autograd.grad(out.float().square().sum(), (x, wt, experts.gate_up_proj))])
print("7 fwd+bwd repeatable:", all(torch.equal(a, b) for a, b in zip(*runs)))
s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("ep",))
for _, b in moe_blocks(model):
    apply_expert_parallel(b.experts, mesh)
h = torch.randn(4096, Hd, device=dev, dtype=x.dtype)
experts(h, idx, wt.detach())
if cuda:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    experts(h, idx, wt.detach())
if cuda:
    torch.cuda.set_sync_debug_mode("default")
print("8 syncs per EP forward (want 1):", sum("synchroniz" in str(c.message) for c in caught))
for layer in model.model.layers:
    layer.forward = torch.compile(layer.forward, backend="inductor" if cuda else "eager")
torch._dynamo.utils.counters.clear()
for step in range(4):
    model(input_ids=torch.randint(0, 257, (2, 256), device=dev)).logits.float().sum().backward()
    c = torch._dynamo.utils.counters
    print(
        "8 step",
        step,
        "graphs",
        c["stats"]["unique_graphs"],
        "frames",
        c["frames"]["total"],
        "breaks",
        sum(c["graph_break"].values()),
    )
dist.destroy_process_group()
