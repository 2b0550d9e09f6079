"""Tokenizers: the built-in byte-level one and local Hugging Face tokenizer directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from meshtron.errors import ConfigError


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 is end-of-sequence."""

    name = "byte"
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        arr = arr[(arr >= 0) & (arr < 256)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer directory, loaded without network access."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        self.name = str(Path(path).expanduser().resolve())
        try:
            self.tok = AutoTokenizer.from_pretrained(
                self.name, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception as err:  # noqa: BLE001 - surface any loader failure as a config error
            raise ConfigError(
                f"data.tokenizer: could not load a Hugging Face tokenizer from '{self.name}' ({err}); "
                "point data.tokenizer at a directory with tokenizer.json / tokenizer_config.json, or use 'byte'"
            ) from None
        if self.tok.eos_token_id is None:
            raise ConfigError(
                f"data.tokenizer: the tokenizer in '{self.name}' has no EOS token; "
                "set eos_token in its tokenizer_config.json or use data.tokenizer=byte"
            )
        self.eos_token_id = int(self.tok.eos_token_id)
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        ids = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary (token -> id), the same for the same tokenizer wherever its folder is."""
    import hashlib
    import json

    vocab = tokenizer.tok.get_vocab() if hasattr(tokenizer, "tok") else {"byte": tokenizer.vocab_size}
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def load_tokenizer(spec: str, trust_remote_code: bool = False) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` gives the ByteTokenizer; anything else must be a local tokenizer directory."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isdir(os.path.expanduser(spec)):
        raise ConfigError(
            f"data.tokenizer: '{spec}' is not 'byte' nor an existing tokenizer directory; "
            "set data.tokenizer=byte or to a local Hugging Face tokenizer folder (download it first)"
        )
    return HFTokenizer(spec, trust_remote_code=trust_remote_code)
