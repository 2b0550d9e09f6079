"""A one-layer Llama and a character-level tokenizer, saved with ``save_pretrained`` as a local folder or the hub
holds them (test_hub, test_auto_tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch

CHARACTERS = ["<unk>", "</s>"] + [chr(c) for c in range(32, 127)]
"""The tokenizer's vocabulary: 97 ids, ``</s>`` its EOS."""


def save_tiny_llama(folder: Path, seed: int, vocab_size: int = 128) -> None:
    """A one-layer Llama of ``vocab_size`` ids, initialized from ``seed``, without a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        vocab_size=vocab_size,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def save_character_tokenizer(folder: Path) -> None:
    """The character-level tokenizer (``CHARACTERS``) as a fast Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(CHARACTERS)}, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
