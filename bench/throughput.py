"""meshtron against its peers in one run: same device, model, packed data, batch and document-mask setting.

Runners (each in its own process, so peak memory and compile caches stay apart):
  meshtron            ``meshtron train``: fp32 master weights, precision.mixed_precision=bf16, train.compile=false
  meshtron-compile    the same with train.compile=true
  plain-bf16, autocast, autocast-compile, hf-trainer, hf-trainer-compile: see bench/peers.py

Tokens/s is steady state: batch x seq_len x (steps - warmup) over the wall time from the end of step
``warmup`` to the end of the last step. MFU uses meshtron's flops_per_token and device peak for every
runner. Peak memory is torch.cuda.max_memory_allocated per process (peak RSS on CPU). Examples:

    python bench/throughput.py                      # CPU smoke run: llama-small, seq 256, no compiled runners
    python bench/throughput.py --batch 4 8 --json out.json   # CUDA: llama-1b, seq 2048, all runners
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshtron.config import load_config
from meshtron.data.tokenizer import load_tokenizer
from meshtron.metrics.flops import device_peak_flops, flops_per_token
from meshtron.models.build import load_hf_config

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from peers import PEER_NEEDS, PEERS, data_overrides  # noqa: E402

MESHTRON = {
    "meshtron": "meshtron train: model.dtype=float32 (master), precision.mixed_precision=bf16, train.compile=false",
    "meshtron-compile": (
        "meshtron train: model.dtype=float32 (master), precision.mixed_precision=bf16, train.compile=true"
    ),
}
RUNNERS = [*MESHTRON, *PEERS]
COMPILED = [name for name in RUNNERS if name.endswith("-compile")]


def subprocess_env() -> dict:
    """meshtron importable from the checkout, and fresh compile caches for each runner."""
    root = str(BENCH.parent)
    caches = tempfile.mkdtemp(prefix="meshtron-throughput-cache-")
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
        TRITON_CACHE_DIR=os.path.join(caches, "triton"),
    )


def run_logged(command: list[str], workdir: Path, timeout: float) -> str | None:
    """Run ``command`` with its output in ``workdir/log.txt``; None when it succeeds, else its error line."""
    log = workdir / "log.txt"
    env = subprocess_env()
    try:
        with open(log, "w") as out:
            code = subprocess.run(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=BENCH.parent
            ).returncode
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    finally:
        shutil.rmtree(Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent, ignore_errors=True)
    if code == 0:
        return None
    lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
    if any("out of memory" in line.lower() for line in lines):
        return "out of memory"
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit code {code}"])[-1]


def run_meshtron(name: str, args, batch: int, workdir: Path) -> dict:
    """``meshtron train`` through its command line; tokens/s and memory from its metrics.jsonl."""
    overrides = (
        data_overrides(args.preset, args.seq_len, args.documents)
        + [
            f"data.mask_documents={str(args.mask_documents).lower()}",
            f"train.steps={args.steps}",
            f"train.global_batch_size={batch}",
            "model.dtype=float32",
            "precision.mixed_precision=bf16",
            f"train.compile={'true' if name == 'meshtron-compile' else 'false'}",
            f"run.device={args.device}",
            f"run.output_dir={workdir / 'run'}",
            "run.progress=false",
        ]
        + args.meshtron_set
    )
    command = [sys.executable, "-m", "meshtron", "train"] + [f"--{item}" for item in overrides]
    error = run_logged(command, workdir, args.timeout)
    metrics = workdir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = {r["step"]: r for r in records}
    if error or args.steps not in steps:
        return {"error": error or "no metrics.jsonl"}
    seconds = steps[args.steps]["elapsed_s"] - steps[args.warmup]["elapsed_s"]
    return {
        "tokens_per_s": batch * args.seq_len * (args.steps - args.warmup) / seconds,
        "peak_memory_gb": max(r["max_memory_gb"] for r in records),
        "loss_first": records[0]["loss"],
        "loss_last": steps[args.steps]["loss"],
    }


def run_peer(name: str, args, batch: int, workdir: Path) -> dict:
    missing = PEER_NEEDS.get(name)
    if missing and importlib.util.find_spec(missing) is None:
        return {"skipped": f"install {missing}"}
    out = workdir / "result.json"
    command = [
        sys.executable,
        str(BENCH / "peers.py"),
        name,
        "--preset",
        args.preset,
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--documents",
        str(args.documents),
        "--device",
        args.device,
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        "--mask-documents" if args.mask_documents else "--no-mask-documents",
    ]
    error = run_logged(command, workdir, args.timeout)
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": error or "no result"}


def measure(name: str, args, batch: int, workdir: Path) -> dict:
    """One runner at one batch size, in its own process(es); prints a line as it finishes."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    started = time.perf_counter()
    run = run_meshtron if name in MESHTRON else run_peer
    result = {"runner": name, "batch": batch, **run(name, args, batch, workdir)}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if "tokens_per_s" in result:
        print(
            f"{name} batch {batch}: {result['tokens_per_s']:,.0f} tokens/s, {result['peak_memory_gb']:.2f} GB, "
            f"{result['wall_s']:.0f} s",
            flush=True,
        )
    else:
        status = f"skipped: {result['skipped']}" if "skipped" in result else f"failed: {result['error']}"
        print(f"{name} batch {batch}: {status}", flush=True)
    return result


def model_flops(args) -> tuple[float, int]:
    """flops_per_token and parameter count of the preset, as meshtron builds it."""
    cfg = load_config(None, data_overrides(args.preset, args.seq_len, args.documents), env={})
    hf_config = load_hf_config(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    return flops_per_token(hf_config, args.seq_len), params


def table(results: list[dict], baseline: str | None) -> str:
    ratio_title = f"vs {baseline}" if baseline else "ratio"
    rows = [
        f"| runner | batch | tokens/s | MFU | peak mem GB | {ratio_title} | loss first -> last | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    reference = {r["batch"]: r.get("tokens_per_s") for r in results if r["runner"] == baseline}
    for r in results:
        if "tokens_per_s" not in r:
            status = f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error'][:160]}"
            rows.append(f"| {r['runner']} | {r['batch']} | {status} | | | | | {r.get('wall_s', '')} |")
            continue
        ref = reference.get(r["batch"])
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "-"
        rows.append(
            f"| {r['runner']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_memory_gb']:.2f} | {ratio} "
            f"| {r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b" if cuda else "llama-small")
    parser.add_argument("--seq-len", type=int, default=2048 if cuda else 256)
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=20 if cuda else 8)
    parser.add_argument("--warmup", type=int, default=5 if cuda else 3, help="steps left out of tokens/s")
    parser.add_argument("--documents", type=int, default=400, help="data.max_documents of the builtin corpus")
    parser.add_argument("--mask-documents", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--runners",
        nargs="+",
        choices=RUNNERS,
        help="default: all on CUDA; on CPU all but the compiled ones (compiling is slow there)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--meshtron-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra meshtron settings, e.g. train.loss_chunk_size=0",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per runner")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="keep each runner's log and meshtron run folder under this folder")
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error("need 0 < --warmup < --steps")
    runners = list(dict.fromkeys(args.runners or [n for n in RUNNERS if args.device == "cuda" or n not in COMPILED]))
    if args.runners is None and args.device == "cpu":
        print(f"CPU: compiled runners ({', '.join(COMPILED)}) left out; name them in --runners to include them")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    peak = device_peak_flops(torch.device(args.device))
    flops_tok, params = model_flops(args)
    import transformers

    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": args.preset,
        "parameters": params,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "mask_documents": args.mask_documents,
        "flops_per_token": flops_tok,
        "peak_flops": peak,
        "meshtron_set": args.meshtron_set,
    }
    print(
        f"{device_name}, torch {torch.__version__}, transformers {transformers.__version__} | {args.preset} "
        f"({params / 1e6:,.1f}M parameters), seq {args.seq_len}, {args.steps} steps ({args.warmup} warm-up), "
        f"document masks {'on' if args.mask_documents else 'off'}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="meshtron-throughput-") as tmp:
        for batch in args.batch:
            for name in runners:
                result = measure(name, args, batch, (args.keep or Path(tmp)) / f"{name}-{batch}")
                if "tokens_per_s" in result:
                    result["mfu"] = flops_tok * result["tokens_per_s"] / peak if peak else None
                results.append(result)
                if args.json:  # after every runner, so that a run cut short keeps what it measured
                    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    measured = {r["runner"] for r in results if "tokens_per_s" in r}
    baseline = next((b for b in ("hf-trainer-compile", "hf-trainer") if b in measured), None)
    print()
    print(table(results, baseline))
    print()
    for name in runners:
        print(f"- {name}: {MESHTRON.get(name) or PEERS[name]}")
    if args.mask_documents:
        print(
            "- document masks: meshtron's own block-causal SDPA mask; the peers pass position ids restarting at "
            "every document, from which transformers builds the same mask for sdpa (no flash-attention varlen)"
        )


if __name__ == "__main__":
    main()
