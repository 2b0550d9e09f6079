"""Runs several training layouts in one torchrun launch (one transformers import per process).

Usage: torchrun --nproc-per-node N tests/parity_worker.py SPEC.json OUT_DIR
SPEC.json: {"base": [overrides...], "layouts": {name: [overrides...]}}; an override ``env:VAR=VALUE`` sets an
environment variable for that layout only (e.g. ``env:MESHTRON_FAULT=nan:step=6``). For each layout, rank 0 writes
OUT_DIR/<name>.json (per-step losses and grad norms, the largest parameter + gradient + optimizer
bytes of any rank, the largest activation peak and the largest gradient bytes held between accumulated
micro-batches) and OUT_DIR/<name>.pt (full final weights).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from meshtron.config import load_config
from meshtron.train.runtime import init_runtime, shutdown_runtime
from meshtron.metrics.logger import local_bytes
from meshtron.train.preflight import preflight
from meshtron.train.trainer import train


def expert_state_bytes(result) -> tuple[torch.Tensor, int]:
    """(bytes this rank holds of the experts' parameters and AdamW state, bytes of all of it unsharded) after the
    run: the local shards of every ``.experts.`` parameter and of its optimizer state, against their full sizes."""
    local = full = 0
    for part in result.model_parts:
        for name, param in part.named_parameters():
            if ".experts." not in name:
                continue
            tensors = [param] + [v for v in result.optimizer.state.get(param, {}).values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0]
            local += sum(local_bytes(t) for t in tensors)
            full += len(tensors) * param.numel() * param.element_size()
    return torch.tensor([local], dtype=torch.int64), full


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    runtime = init_runtime()
    try:
        for name, overrides in spec["layouts"].items():
            env = dict(item[len("env:"):].split("=", 1) for item in overrides if item.startswith("env:"))
            overrides = [item for item in overrides if not item.startswith("env:")]
            cfg = load_config(None, spec["base"] + overrides + [f"run.output_dir={out / name}"], env={})
            plan = preflight(cfg, runtime.world_size, runtime.device.type)
            os.environ.update(env)
            try:
                result = train(cfg, runtime, plan)
            finally:
                for var in env:
                    os.environ.pop(var)
            measured = torch.tensor(
                [sum(result.state_bytes.values()), result.activation_bytes, result.accumulation_grad_bytes],
                dtype=torch.int64,
            )
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            expert_local, expert_full = expert_state_bytes(result)
            dist.all_reduce(expert_local, op=dist.ReduceOp.MAX)
            options = StateDictOptions(full_state_dict=True)  # on every rank (cpu_offload would keep it on rank 0 only)
            state = {}
            for part in result.model_parts:  # pipeline stages: each holds some of the parameters, names unchanged
                state.update(get_model_state_dict(part, options=options))
            if plan.dims.pp > 1:
                pieces = [None] * runtime.world_size
                dist.all_gather_object(pieces, state)
                state = {name: tensor for piece in pieces for name, tensor in piece.items()}
            if runtime.is_main:
                torch.save(state, out / f"{name}.pt")
                (out / f"{name}.json").write_text(json.dumps(
                    {"losses": result.losses, "grad_norms": result.grad_norms, "state_bytes": int(measured[0]),
                     "activation_bytes": int(measured[1]),
                     "accumulation_grad_bytes": int(measured[2]),
                     "expert_state_bytes": [int(expert_local), expert_full]}
                ))
            del result, state
    finally:
        shutdown_runtime()


if __name__ == "__main__":
    main()
