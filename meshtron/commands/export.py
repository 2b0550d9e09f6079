"""``meshtron export CHECKPOINT OUT_DIR``: a checkpoint as a Hugging Face model directory, or a LoRA run's adapters as
a peft adapter directory (meshtron.checkpoint.export)."""

from __future__ import annotations

import argparse

from meshtron.errors import ConfigError

NAMES = ("export",)


def add_parser(sub) -> None:
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoint folder (e.g. runs/X/checkpoints/step-00000100)")
    export.add_argument("out_dir", help="new directory for config.json + safetensors (+ tokenizer)")
    export.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (default 2GB)")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapters as a peft adapter directory (default: the merged model)",
    )
    export.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model's and tokenizer's own Python code (never taken from the checkpoint)",
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"unexpected arguments {extra}; usage: meshtron export CHECKPOINT OUT_DIR")
    from meshtron.checkpoint.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out_dir, args.max_shard_size, args.trust_remote_code, args.adapter)
    loads_with = "peft.PeftModel.from_pretrained" if args.adapter else "AutoModelForCausalLM.from_pretrained"
    print(f"meshtron: exported {args.checkpoint} to {out}/ (loads with {loads_with})")
    return 0
