"""The peers meshtron is compared with in ``bench/throughput.py``; each runs alone in its own process.

Every peer trains the same Hugging Face model (meshtron's preset config, sdpa attention) on the same
packed sequences in the same order as ``meshtron train``. With document masks on, the peers pass
position ids that restart at every document (as meshtron does) and no attention mask: transformers
then builds the same block-causal SDPA mask meshtron uses. Worker usage (``throughput.py`` calls it):

    python bench/peers.py autocast-compile --preset llama-1b --seq-len 2048 --batch 8 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshtron.config import load_config
from meshtron.data.dataset import build_packed_dataset
from meshtron.data.sampler import GlobalBatchSchedule
from meshtron.data.tokenizer import load_tokenizer
from meshtron.metrics.memory import max_memory_gb
from meshtron.models.attention import document_ids, document_positions
from meshtron.models.build import load_hf_config

PEERS = {
    "plain-bf16": "bf16 weights, grads and AdamW state; fused AdamW; eager",
    "autocast": "fp32 master weights + torch.autocast(bf16); fused AdamW; eager",
    "autocast-compile": "fp32 master weights + torch.autocast(bf16); fused AdamW; torch.compile(model)",
    "hf-trainer": "transformers Trainer, bf16=True (fp32 master + autocast), optim=adamw_torch_fused",
    "hf-trainer-compile": "transformers Trainer, bf16=True, optim=adamw_torch_fused, torch_compile=True",
}
PEER_NEEDS = {"hf-trainer": "accelerate", "hf-trainer-compile": "accelerate"}
"""Packages a peer needs beyond meshtron's own dependencies."""


def data_overrides(preset: str, seq_len: int, documents: int) -> list[str]:
    """The config settings that fix model and data: meshtron and every peer use exactly these."""
    return [f"model.preset={preset}", f"data.seq_len={seq_len}", f"data.max_documents={documents}"]


class Setup:
    """Model config, packed data and meshtron's global batch order for one run."""

    def __init__(self, args):
        cfg = load_config(None, data_overrides(args.preset, args.seq_len, args.documents), env={})
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.hf_config = load_hf_config(cfg.model, self.tokenizer.vocab_size)
        self.dataset = build_packed_dataset(cfg.data, self.tokenizer, is_builder=True)
        self.schedule = GlobalBatchSchedule(len(self.dataset), args.batch, cfg.data.shuffle, cfg.data.seed)
        self.mask_documents = args.mask_documents

    def sequence(self, position: int) -> dict[str, torch.Tensor]:
        """Sample ``position`` of meshtron's global order: input_ids, labels (already shifted) and position_ids."""
        input_ids, labels = self.dataset.batch(self.schedule.indices(position, 1))
        item = {"input_ids": input_ids[0], "labels": labels[0]}
        if self.mask_documents:
            item["position_ids"] = self.positions(input_ids)[0]
        return item

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        return document_positions(document_ids(input_ids, self.tokenizer.eos_token_id))

    def model(self, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(self.hf_config, attn_implementation="sdpa", dtype=dtype)


def resolve_device(name: str) -> torch.device:
    """``name`` as a device; a CUDA one always with an index (LOCAL_RANK, else the current device), since
    ``torch.cuda.set_device(torch.device("cuda"))`` raises on torch 2.11."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        index = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(index) if index is not None else torch.cuda.current_device())
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(setup: Setup, args, device: torch.device, name: str) -> dict:
    """The loop a user writes by hand: forward, float32 cross-entropy, backward, clip, fused AdamW."""
    bf16_weights = name == "plain-bf16"
    model = setup.model(device, torch.bfloat16 if bf16_weights else torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    forward = torch.compile(model) if name.endswith("-compile") else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not bf16_weights)
    losses = []
    for step in range(args.steps):
        if step == args.warmup:
            sync(device)
            started = time.perf_counter()
        input_ids, labels = setup.dataset.batch(setup.schedule.global_batch(step))
        input_ids, labels = input_ids.to(device), labels.to(device)
        position_ids = setup.positions(input_ids) if setup.mask_documents else None
        with autocast:
            logits = forward(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        del logits, loss
    sync(device)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "losses": torch.stack(losses).float().tolist()}


def hf_trainer(setup: Setup, args, device: torch.device, name: str) -> dict:
    """transformers' Trainer as its documentation suggests for bf16 training, timed by a callback."""
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Sequences(Dataset):
        def __len__(self):
            return args.steps * args.batch

        def __getitem__(self, position):
            item = setup.sequence(position)
            item["shift_labels"] = item["labels"]  # our labels are already shifted: HF must not shift again
            return item

    losses, marks = [], {}

    class InOrder(Trainer):
        """Meshtron's batch order (the default sampler shuffles), and the loss of every step kept on device."""

        def _get_train_sampler(self, *unused, **kw):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *rest, **kw):
            loss = super().compute_loss(model, inputs, *rest, **kw)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).detach())
            return loss

    class Clock(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kw):
            if state.global_step in (args.warmup, args.steps):
                sync(device)
                marks[state.global_step] = time.perf_counter()

    training_args = TrainingArguments(
        output_dir=str(args.workdir / "hf"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=3e-4,
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        bf16=True,
        optim="adamw_torch_fused",
        torch_compile=name.endswith("-compile"),
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        use_cpu=device.type == "cpu",
        seed=0,
    )
    model = setup.model(device, torch.float32)
    trainer = InOrder(model=model, args=training_args, train_dataset=Sequences(), callbacks=[Clock()])
    trainer.train()
    return {"seconds": marks[args.steps] - marks[args.warmup], "losses": torch.stack(losses).float().tolist()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runner", choices=sorted(PEERS))
    parser.add_argument("--preset", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--documents", type=int, required=True)
    parser.add_argument("--mask-documents", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    setup = Setup(args)
    run = hf_trainer if args.runner.startswith("hf-trainer") else hand_loop
    try:
        timed = run(setup, args, device, args.runner)
    except torch.OutOfMemoryError:
        args.out.write_text(json.dumps({"error": "out of memory"}))
        return
    tokens = args.batch * args.seq_len * (args.steps - args.warmup)
    result = {
        "tokens_per_s": tokens / timed["seconds"],
        "peak_memory_gb": max_memory_gb(device),
        "loss_first": timed["losses"][0],
        "loss_last": timed["losses"][-1],
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
