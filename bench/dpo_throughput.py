"""DPO training throughput: meshtron (``train.objective=dpo``, a live frozen reference) against TRL's DPOTrainer with
the same model, pairs, batch and settings, each runner in its own process.

The pairs are synthetic: a prompt of ``--prompt-tokens`` random letters and two different answers of
``--answer-tokens`` tokens each (letters, then EOS), in tokens the same for both runners (meshtron's byte tokenizer;
TRL gets a tokenizer whose ids are those bytes). A pair's sequences are ``L = prompt + answer`` tokens long:
meshtron puts both in one row of ``data.seq_len = 2 (L + 1)`` tokens (each sequence and its separator), TRL pads
nothing (``max_length = L``, every sequence exactly ``L``). Runners:

  meshtron            meshtron train: model.dtype=float32 (master), precision.mixed_precision=bf16, reference=model
  meshtron-compile    the same with train.compile=true
  trl                 DPOTrainer: bf16=True (fp32 master + autocast), optim=adamw_torch_fused, no gradient checkpointing
  trl-compile         the same with torch_compile=True (TRL compiles the policy; its reference runs eager)

Pairs/s is steady state: batch x (steps - warmup) over the wall time from the end of step ``warmup`` to the end of
the last; tokens/s is pairs/s x 2 L (the tokens of a pair's two sequences, the same count for both runners). Peak
memory is torch.cuda.max_memory_allocated per process (peak RSS on CPU). Examples:

    python bench/dpo_throughput.py --batch 4 8 --json dpo.json      # CUDA: llama-1b, 512 + 511 tokens, all runners
    python bench/dpo_throughput.py --tiny                           # CPU smoke run: llama-tiny, meshtron and trl
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from throughput import run_logged  # noqa: E402

MESHTRON = {
    "meshtron": "meshtron train: float32 master weights, bf16 compute, preference.reference=model, eager",
    "meshtron-compile": "meshtron train: float32 master weights, bf16 compute, preference.reference=model, compiled",
}
TRL = {
    "trl": "TRL DPOTrainer: bf16=True, optim=adamw_torch_fused, gradient_checkpointing=False, reference a copy, eager",
    "trl-compile": "TRL DPOTrainer: the same with torch_compile=True (the policy compiled, the reference eager)",
}
RUNNERS = [*MESHTRON, *TRL]
LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
EOS = 256
"""meshtron's byte tokenizer's end-of-sequence id; TRL's tokenizer gets the same."""
LEARNING_RATE = 1e-5
BETA = 0.1


def pair_records(count: int, prompt_tokens: int, answer_tokens: int, seed: int = 0) -> list[dict]:
    """``count`` plain-string pairs: a prompt of ``prompt_tokens`` letters and two different answers of
    ``answer_tokens - 1`` letters (both runners append EOS)."""
    rng = np.random.default_rng(seed)

    def text(length: int) -> str:
        return LETTERS[rng.integers(0, len(LETTERS), size=length)].tobytes().decode()

    records = []
    for _ in range(count):
        chosen = text(answer_tokens - 1)
        rejected = text(answer_tokens - 1)
        while rejected == chosen:
            rejected = text(answer_tokens - 1)
        records.append({"prompt": text(prompt_tokens), "chosen": chosen, "rejected": rejected})
    return records


def sequence_tokens(args) -> int:
    """``L``: tokens of one sequence, prompt + answer (EOS included)."""
    return args.prompt_tokens + args.answer_tokens


def write_pairs(args, path: Path) -> Path:
    records = pair_records(max(args.batch) * args.steps, args.prompt_tokens, args.answer_tokens)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_meshtron(name: str, args, batch: int, workdir: Path, data: Path) -> dict:
    """``meshtron train`` through its command line; times and memory from its metrics.jsonl."""
    length = sequence_tokens(args)
    overrides = [
        f"model.preset={args.preset}",
        "train.objective=dpo",
        f"dpo.beta={BETA}",
        "data.format=preference",
        f"data.path={data}",
        f"data.seq_len={2 * (length + 1)}",
        f"preference.max_length={length}",
        "preference.reference=model",
        f"train.steps={args.steps}",
        f"train.global_batch_size={batch}",
        f"optimizer.lr={LEARNING_RATE}",
        "schedule.kind=constant",
        "schedule.warmup_steps=0",
        "schedule.min_lr=0",
        "model.dtype=float32",
        "precision.mixed_precision=bf16",
        f"train.compile={'true' if name == 'meshtron-compile' else 'false'}",
        f"run.device={args.device}",
        f"run.output_dir={workdir / 'run'}",
        "run.progress=false",
        *args.meshtron_set,
    ]
    command = [sys.executable, "-m", "meshtron", "train"] + [f"--{item}" for item in overrides]
    error = run_logged(command, workdir, args.timeout)
    metrics = workdir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = {r["step"]: r for r in records}
    if error or args.steps not in steps:
        return {"error": error or "no metrics.jsonl"}
    return {
        "seconds": steps[args.steps]["elapsed_s"] - steps[args.warmup]["elapsed_s"],
        "peak_memory_gb": max(r["max_memory_gb"] for r in records),
        "loss_first": records[0]["loss"],
        "loss_last": steps[args.steps]["loss"],
        "accuracy_last": steps[args.steps].get("rewards/accuracies"),
    }


def run_trl(name: str, args, batch: int, workdir: Path, data: Path) -> dict:
    """TRL's DPOTrainer in a process of its own (this script's ``--worker``)."""
    if importlib.util.find_spec("trl") is None:
        return {"skipped": "install trl"}
    out = workdir / "result.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--preset",
        args.preset,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--answer-tokens",
        str(args.answer_tokens),
        "--batch",
        str(batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--data",
        str(data),
        "--json",
        str(out),
    ]
    error = run_logged(command, workdir, args.timeout)
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": error or "no result"}


def byte_tokenizer():
    """A Hugging Face fast tokenizer whose ids are meshtron's byte tokenizer's: a letter's id is its byte, EOS 256."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(b): b for b in range(32, 127)} | {"<unk>": 0, "</s>": EOS}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="</s>")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trl_worker(args) -> dict:
    """DPOTrainer on the preset's model (float32 weights, seed 0) and the pairs' JSONL; seconds between the ends of
    steps ``warmup`` and ``steps``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from meshtron.config import load_config
    from meshtron.models.build import load_hf_config

    device = torch.device(args.device)
    cfg = load_config(None, [f"model.preset={args.preset}"], env={})
    hf_config = load_hf_config(cfg.model, EOS + 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # TRL would load the same weights from the hub id
    records = [json.loads(line) for line in args.data.read_text().splitlines()]
    losses, marks = [], {}

    class Clock(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kw):
            if state.global_step in (args.warmup, args.steps):
                sync(device)
                marks[state.global_step] = time.perf_counter()

    class KeepLosses(DPOTrainer):
        def compute_loss(self, model, inputs, *rest, **kw):
            loss = super().compute_loss(model, inputs, *rest, **kw)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())
            return loss

    training_args = DPOConfig(
        output_dir=str(args.json.parent / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch[0],
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        beta=BETA,
        max_length=sequence_tokens(args),
        precompute_ref_log_probs=False,
        gradient_checkpointing=False,
        bf16=True,
        optim="adamw_torch_fused",
        torch_compile=args.worker == "trl-compile",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        seed=0,
    )
    trainer = KeepLosses(
        model=model,
        ref_model=reference,
        args=training_args,
        train_dataset=Dataset.from_list(records),
        processing_class=byte_tokenizer(),
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        "seconds": marks[args.steps] - marks[args.warmup],
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
    }


def worker_main(args) -> None:
    from meshtron.metrics.memory import max_memory_gb

    try:
        result = trl_worker(args)
    except torch.OutOfMemoryError:
        result = {"error": "out of memory"}
    else:
        result["peak_memory_gb"] = max_memory_gb(torch.device(args.device))
    args.json.write_text(json.dumps(result))


def measure(name: str, args, batch: int, workdir: Path, data: Path) -> dict:
    """One runner at one batch size; adds pairs/s and tokens/s and prints a line as it finishes."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    started = time.perf_counter()
    run = run_meshtron if name in MESHTRON else run_trl
    result = {"runner": name, "batch": batch, **run(name, args, batch, workdir, data)}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if "seconds" in result:
        result["pairs_per_s"] = batch * (args.steps - args.warmup) / result.pop("seconds")
        result["tokens_per_s"] = result["pairs_per_s"] * 2 * sequence_tokens(args)
    print(f"{name} batch {batch}: {status(result)}", flush=True)
    return result


def status(result: dict) -> str:
    if "pairs_per_s" in result:
        return (
            f"{result['pairs_per_s']:,.2f} pairs/s, {result['tokens_per_s']:,.0f} tokens/s, "
            f"{result['peak_memory_gb']:.2f} GB, {result['wall_s']:.0f} s"
        )
    return f"skipped: {result['skipped']}" if "skipped" in result else f"failed: {result['error']}"


def table(results: list[dict]) -> str:
    """A markdown row per runner and batch; the ratio is to TRL's compiled (else eager) runner at the same batch."""
    rows = [
        "| runner | batch | pairs/s | tokens/s | peak mem GB | vs TRL | loss first -> last | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in results:
        if "pairs_per_s" not in r:
            rows.append(f"| {r['runner']} | {r['batch']} | {status(r)[:160]} | | | | | {r.get('wall_s', '')} |")
            continue
        peers = {p["runner"]: p["pairs_per_s"] for p in results if p["batch"] == r["batch"] and "pairs_per_s" in p}
        ref = peers.get("trl-compile") or peers.get("trl")
        ratio = f"{r['pairs_per_s'] / ref:.2f}" if ref else "-"
        rows.append(
            f"| {r['runner']} | {r['batch']} | {r['pairs_per_s']:,.2f} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_memory_gb']:.2f} | {ratio} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} "
            f"| {r['wall_s']:.0f} |"
        )
    return "\n".join(rows)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: llama-tiny, 24 + 16 tokens, 4 steps")
    parser.add_argument("--preset", help="model preset (llama-1b; --tiny: llama-tiny)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens of each prompt (512; --tiny: 24)")
    parser.add_argument("--answer-tokens", type=int, help="tokens of each answer, EOS included (511; --tiny: 16)")
    parser.add_argument("--batch", type=int, nargs="+", help="pairs per step (4 8; --tiny: 2)")
    parser.add_argument("--steps", type=int, help="steps per runner (14; --tiny: 4)")
    parser.add_argument("--warmup", type=int, help="steps left out of the rates (6; --tiny: 2)")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, help="default: compiled on CUDA, eager on CPU")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--meshtron-set", nargs="*", default=[], metavar="KEY=VALUE", help="extra meshtron settings")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per runner")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="keep each runner's log and run folder under this folder")
    parser.add_argument("--worker", choices=sorted(TRL), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (
        dict(preset="llama-tiny", prompt_tokens=24, answer_tokens=16, batch=[2], steps=4, warmup=2)
        if args.tiny
        else dict(preset="llama-1b", prompt_tokens=512, answer_tokens=511, batch=[4, 8], steps=14, warmup=6)
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.runners is None:
        args.runners = ["meshtron-compile", "trl-compile"] if args.device == "cuda" else ["meshtron", "trl"]
    if not 0 < args.warmup < args.steps:
        parser.error("need 0 < --warmup < --steps")
    if args.answer_tokens < 2:
        parser.error("--answer-tokens counts EOS: at least 2")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    import transformers

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    trl_version = importlib.util.find_spec("trl") and __import__("trl").__version__
    length = sequence_tokens(args)
    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl_version,
        "preset": args.preset,
        "prompt_tokens": args.prompt_tokens,
        "answer_tokens": args.answer_tokens,
        "meshtron_seq_len": 2 * (length + 1),
        "steps": args.steps,
        "warmup": args.warmup,
        "meshtron_set": args.meshtron_set,
    }
    print(
        f"{device_name}, torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version} | "
        f"{args.preset}, DPO pairs of {args.prompt_tokens} + {args.answer_tokens} tokens (meshtron seq "
        f"{2 * (length + 1)}, TRL max_length {length}), {args.steps} steps ({args.warmup} warm-up)",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="meshtron-dpo-throughput-") as tmp:
        data = write_pairs(args, Path(tmp) / "pairs.jsonl")
        for batch in args.batch:
            for name in args.runners:
                results.append(measure(name, args, batch, (args.keep or Path(tmp)) / f"{name}-{batch}", data))
                if args.json:  # after every runner, so that a run cut short keeps what it measured
                    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print()
    print(table(results))
    print()
    for name in args.runners:
        print(f"- {name}: {MESHTRON.get(name) or TRL[name]}")


if __name__ == "__main__":
    main()
