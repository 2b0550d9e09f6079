"""Muon's per-rank orthogonalization work, before and after the owner exchange (meshtron.train.optim.muon), on one
device.

Rank 0 of a fake 8-rank world (torch's fake process group: collectives return at once, so this times the
Newton-Schulz iterations and copies one rank does, not the network) holds llama-1b's block matrices (16 layers of
q, k, v, o, gate, up, down) sharded by FSDP over 8 ranks. "before": every matrix gathered whole in float32
(``full_tensor``) and orthogonalized on every rank, as Muon did; "after": ``orthogonalized``, each matrix on one
owner, the shards exchanged in the Newton-Schulz dtype. Newton-Schulz in bf16 (a bf16 run's), 5 iterations.

Usage: python bench/muon_exchange.py [--scale 16]   (on CUDA when available; --scale divides the matrix sizes)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshtron.train.optim import muon


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=1, help="divide llama-1b's matrix sizes by this")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    if device == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(device, (8,))
    hidden, ffn, kv = 2048 // args.scale, 8192 // args.scale, 512 // args.scale
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden)]
    shapes = (shapes + [(hidden, ffn)]) * 16
    updates = [distribute_tensor(torch.randn(s, device=device), mesh, [Shard(0)], src_data_rank=None) for s in shapes]

    def timed(step) -> float:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.reps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.reps

    after = timed(lambda: list(muon.orthogonalized(updates, lambda u: u, 5, torch.bfloat16)))
    before = timed(lambda: [muon.newton_schulz(u.full_tensor(), 5, torch.bfloat16) for u in updates])
    print(
        f"{device} ({torch.__version__}): Muon orthogonalization per rank, llama-1b/{args.scale} matrices, FSDP8: "
        f"before {before * 1e3:.1f} ms (every matrix, float32 gather), after {after * 1e3:.1f} ms (one owner each)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
