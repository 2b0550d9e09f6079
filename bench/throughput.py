"""meshtron (1 process) vs a plain hand-written transformers + AdamW loop: same model, data and steps.

Runs alternate (meshtron, plain, plain, meshtron, ...) so drift in machine speed hits both alike.
Tokens/s excludes the first ``--warmup`` steps of each run. Example:

    python bench/throughput.py                                  # CPU, llama-small, seq 256
    python bench/throughput.py --preset llama-1b --seq-len 2048 --dtype bfloat16 --batch 4 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshtron.config import load_config
from meshtron.data.dataset import build_packed_dataset
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.tokenizer import load_tokenizer
from meshtron.models.build import build_meta_model, load_hf_config, materialize, torch_dtype
from meshtron.train.runtime import Runtime
from meshtron.train.trainer import train


def make_config(args, output_dir: Path):
    return load_config(
        None,
        [
            f"model.preset={args.preset}",
            f"model.dtype={args.dtype}",
            f"data.seq_len={args.seq_len}",
            f"data.max_documents={args.documents}",
            f"train.steps={args.steps}",
            f"train.global_batch_size={args.batch}",
            "train.warmup_steps=2",
            "run.progress=false",
            f"run.output_dir={output_dir}",
        ],
        env={},
    )


def run_meshtron(args, device: torch.device, workdir: Path, index: int) -> float:
    cfg = make_config(args, workdir / f"meshtron-{index}")
    result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=device))
    rates = result.tokens_per_s[args.warmup:]
    tokens = args.batch * args.seq_len
    return tokens * len(rates) / sum(tokens / rate for rate in rates)


def run_plain(args, device: torch.device, workdir: Path) -> float:
    """The loop a user would write by hand with transformers and torch.optim.AdamW."""
    cfg = make_config(args, workdir / "plain")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    dataset = build_packed_dataset(cfg.data, tokenizer, is_builder=True)
    schedule = GlobalBatchSchedule(len(dataset), args.batch, True, cfg.data.seed)
    hf_config = load_hf_config(cfg.model, tokenizer.vocab_size)
    model, adapter = build_meta_model(hf_config, cfg.model)
    materialize(model, adapter, device, seed=cfg.train.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    step_times = []
    for step in range(args.steps):
        started = time.perf_counter()
        input_ids, labels = dataset.batch(schedule.global_batch(step))
        input_ids, labels = input_ids.to(device), labels.to(device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - started)
    times = step_times[args.warmup:]
    return args.batch * args.seq_len * len(times) / sum(times)


def peak_memory_gb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    meshtron_rates, plain_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for round_index in range(args.rounds):
            order = ("meshtron", "plain") if round_index % 2 == 0 else ("plain", "meshtron")
            for name in order:
                if name == "meshtron":
                    meshtron_rates.append(run_meshtron(args, device, workdir, round_index))
                else:
                    plain_rates.append(run_plain(args, device, workdir))
                print(f"round {round_index + 1} {name:>8}: {(meshtron_rates if name == 'meshtron' else plain_rates)[-1]:,.0f} tokens/s", flush=True)
    from meshtron.metrics.flops import device_peak_flops, flops_per_token
    from meshtron.config import ModelConfig

    hf_config = load_hf_config(ModelConfig(preset=args.preset), load_tokenizer("byte").vocab_size)
    peak = device_peak_flops(device)
    meshtron_median, plain_median = statistics.median(meshtron_rates), statistics.median(plain_rates)
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "preset": args.preset,
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "meshtron_tokens_per_s": round(meshtron_median, 1),
        "plain_tokens_per_s": round(plain_median, 1),
        "ratio": round(meshtron_median / plain_median, 4),
        "meshtron_mfu": round(flops_per_token(hf_config, args.seq_len) * meshtron_median / peak, 4) if peak else None,
        "peak_memory_gb": peak_memory_gb(device),
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
