"""A tiny chat fixture: a character-level tokenizer with a chat template (its turns end with EOS, "</s>") and a
tiny Llama of its vocabulary, in one folder, and conversations as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHAT_MODEL = "chat-llama"
CHAT_DATA = "chat.jsonl"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WORDS = "the a cat dog sat ran on under mat log big red blue green fast slow yes no why how".split()


def write_chat_fixture(directory: Path) -> None:
    if (directory / CHAT_DATA).exists():
        return
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    target = directory / CHAT_MODEL
    tokens = ["<unk>", "</s>"] + [chr(c) for c in range(32, 127)]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # characters back to back
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(target)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        vocab_size=len(tokens),
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
    (directory / CHAT_DATA).write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(300)))


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """Conversations of 1-2 user/assistant exchanges, some with a system message; 1-3 words a message."""
    rng = np.random.default_rng(seed)

    def words() -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 4))))

    result = []
    for _ in range(count):
        messages = [{"role": "system", "content": words()}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 3))):
            messages += [{"role": "user", "content": words() + "?"}, {"role": "assistant", "content": words()}]
        result.append(messages)
    return result
