"""Loads a pretrained HF directory under a parallel layout and checks each rank read only its slices.

Usage: torchrun --nproc-per-node N tests/sharded_load_worker.py SPEC.json
SPEC.json: a list of {"model_dir": ..., "out": OUT_JSON, "overrides": ["section.key=value", ...]}, all loaded
in this one launch (one transformers import per process). For each, rank 0 writes OUT_JSON: max abs
difference of every full weight and of the logits from the single-process model, and the largest
fraction of the checkpoint's elements any rank read.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from meshtron.config import load_config
from meshtron.distributed.parallelize import parallelize_model
from meshtron.models import build
from meshtron.resilience.process_group import init_runtime, shutdown_runtime
from meshtron.train.setup.preflight import preflight
from meshtron.train.setup.run_setup import parallelize_options


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    runtime = init_runtime()
    try:
        for job in jobs:
            check_load(job["model_dir"], job["out"], job["overrides"], runtime)
    finally:
        shutdown_runtime()


def check_load(model_dir: str, out_json: str, overrides: list[str], runtime) -> None:
    """Load ``model_dir`` under the layout ``overrides`` give and write the comparison to ``out_json``."""
    cfg = load_config(None, [f"model.name_or_path={model_dir}", "data.seq_len=16", *overrides], env={})
    setup = preflight(cfg, runtime.world_size, runtime.device.type)
    read = [0]
    original_get = build.CheckpointReader.get

    def counting_get(self, name, region=None):
        tensor = original_get(self, name, region)
        read[0] += tensor.numel()
        return tensor

    build.CheckpointReader.get = counting_get
    meshes = setup.dims.build_mesh(runtime.device.type)
    model, adapter = build.build_meta_model(setup.hf_config, cfg.model)
    model = parallelize_model(model, adapter, setup.dims, meshes, parallelize_options(cfg, setup))
    build.materialize(model, adapter, runtime.device, seed=0, pretrained_dir=model_dir)
    build.CheckpointReader.get = original_get

    reference, _ = build.build_meta_model(setup.hf_config, cfg.model)
    build.materialize(reference, adapter, runtime.device, seed=0, pretrained_dir=model_dir)
    total = sum(p.numel() for p in reference.parameters())
    fraction = torch.tensor([read[0] / total])
    dist.all_reduce(fraction, op=dist.ReduceOp.MAX)

    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids, use_cache=False).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    logits_diff = (logits - reference(input_ids=ids, use_cache=False).logits).abs().max().item()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if runtime.is_main:
        ref = reference.state_dict()
        diffs = {name: (full[name] - ref[name]).abs().max().item() for name in ref}
        result = {
            "weight_diffs": diffs,
            "logits_diff": logits_diff,
            "max_read_fraction": fraction.item(),
            "same_keys": sorted(full) == sorted(ref),
        }
        with open(out_json, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
