"""``meshtron generate CKPT_OR_EXPORT --prompt TEXT``: sample text from a checkpoint or an exported model
(meshtron.checkpoint.generate)."""

from __future__ import annotations

import argparse

from meshtron.errors import ConfigError

NAMES = ("generate",)


def add_parser(sub) -> None:
    generate = sub.add_parser("generate", help="sample text from a checkpoint or an exported model")
    generate.add_argument("model", help="a checkpoint folder (step-N) or a Hugging Face model directory")
    generate.add_argument(
        "--prompt", default="", help="the text to continue (default: start a new document); with --chat, your message"
    )
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message through the tokenizer's chat template and print only the reply",
    )
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed")
    generate.add_argument("--tokenizer", help="byte or a tokenizer folder (default: the run's, or the model folder's)")
    generate.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is visible)")
    generate.add_argument(
        "--trust-remote-code", action="store_true", help="run the model's and tokenizer's own Python code"
    )


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"unexpected arguments {extra}; see meshtron generate --help")
    from meshtron.checkpoint.generate import generate_text

    text = generate_text(
        args.model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        device=args.device,
        chat=args.chat,
    )
    print(text if args.chat else args.prompt + text)
    return 0
