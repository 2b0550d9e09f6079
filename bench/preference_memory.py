"""Peak CPU memory of preference training with each reference (issue 59): a live ``model`` reference, LoRA's
``lora_base``, ``precomputed`` log-probabilities, and causal LM on the same tokens as the baseline.

Each configuration trains in a fresh process (one rank, CPU, fp32, AdamW): ``--steps`` steps of ``--batch`` pairs of
``--seq-len`` tokens on ``--pairs`` pairs of tests/preference_fixture.py's ``alphabet`` set. Memory is the process's
peak resident set (``getrusage``'s ``ru_maxrss``: what meshtron reports as ``max_memory_gb`` on CPU), printed whole
and above the peak after the imports (torch, transformers and meshtron, ~0.3 GB that every configuration shares), so
that the second column is what the run itself added: model, optimizer state, reference, activations, data; the
median of ``--repeats`` processes, and the spread between them. The
causal-LM baseline trains on text documents made of the same pairs (prompt + chosen, prompt + rejected, one document
each), packed into rows of the same length.

    python bench/preference_memory.py                      # llama-mini, seq 128, batch 8, 4 steps
    python bench/preference_memory.py --preset llama-tiny --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIGURATIONS = {
    "causal LM (same tokens)": ["train.objective=causal_lm", "data.format=text"],
    "DPO, reference: model (frozen copy)": ["preference.reference=model"],
    "DPO, reference: precomputed": ["preference.reference=precomputed"],
    "DPO + LoRA r8, reference: model": ["lora.rank=8", "preference.reference=model"],
    "DPO + LoRA r8, reference: lora_base": ["lora.rank=8", "preference.reference=lora_base"],
    "DPO + LoRA r8, reference: precomputed": ["lora.rank=8", "preference.reference=precomputed"],
}

CHILD = """
import json, resource, sys
import torch
from meshtron.config import load_config
from meshtron.distributed.runtime import Runtime
from meshtron.train.trainer import train
after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = load_config(None, json.loads(sys.argv[1]), env={})
result = train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(p.numel() * p.element_size() for p in result.model.parameters())
print("RESULT " + json.dumps({"after_imports_kib": after_imports, "peak_kib": peak, "weights": weights}))
"""


def write_data(folder: Path, pairs: int) -> tuple[Path, Path]:
    """The preference pairs (JSONL) and the same pairs as text documents."""
    sys.path.insert(0, str(REPO / "tests"))
    from preference_fixture import preference_records, write_preference_jsonl

    preference = folder / "pairs.jsonl"
    write_preference_jsonl(preference, pairs, "alphabet")
    text = folder / "documents.jsonl"
    with open(text, "w") as file:
        for record in preference_records(pairs, "alphabet"):
            for answer in (record["chosen"], record["rejected"]):
                file.write(json.dumps({"text": f"{record['prompt']} {answer}"}) + "\n")
    return preference, text


def measure(name: str, extra: list[str], args, data: tuple[Path, Path], out: Path) -> dict:
    """The configuration's figures: the median over ``args.repeats`` fresh processes (peak RSS varies by a few MiB
    from one process to the next)."""
    runs = [measure_once(name, extra, args, data, out) for _ in range(args.repeats)]
    median = sorted(runs, key=lambda run: run["run_mib"])[len(runs) // 2]
    return {**median, "spread_mib": max(r["run_mib"] for r in runs) - min(r["run_mib"] for r in runs)}


def measure_once(name: str, extra: list[str], args, data: tuple[Path, Path], out: Path) -> dict:
    preference, text = data
    settings = [
        f"model.preset={args.preset}",
        "train.objective=dpo",
        "data.format=preference",
        f"data.path={preference}",
        f"data.seq_len={args.seq_len}",
        f"train.global_batch_size={args.batch}",
        f"train.steps={args.steps}",
        "run.progress=false",
        f"run.output_dir={out / str(len(list(out.iterdir())))}",
        *extra,
    ]
    if "data.format=text" in extra:
        settings = [s for s in settings if not s.startswith(("train.objective=dpo", "data.format=preference"))]
        settings = [s.replace(str(preference), str(text)) for s in settings]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(settings)], capture_output=True, text=True, env=env, cwd=REPO
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    found = json.loads(lines[-1][len("RESULT ") :])
    mib = 1024
    return {
        "configuration": name,
        "peak_mib": found["peak_kib"] / mib,
        "run_mib": (found["peak_kib"] - found["after_imports_kib"]) / mib,
        "weights_mib": found["weights"] / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-mini")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="processes per configuration (the median is shown)")
    parser.add_argument("--json", action="store_true", help="one JSON line per configuration")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder), args.pairs)
        out = Path(folder) / "runs"
        out.mkdir()
        rows = [measure(name, extra, args, data, out) for name, extra in CONFIGURATIONS.items()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(
        f"{args.preset} ({rows[0]['weights_mib']:.1f} MiB of fp32 weights), seq {args.seq_len}, batch {args.batch}, "
        f"{args.steps} steps, CPU: peak RSS in MiB, median of {args.repeats} processes"
    )
    print("| configuration | peak RSS | above the imports | spread |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['configuration']} | {row['peak_mib']:.0f} | {row['run_mib']:.0f} | {row['spread_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
