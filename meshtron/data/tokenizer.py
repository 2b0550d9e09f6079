"""Tokenizers: the built-in byte-level one and local Hugging Face tokenizer directories, and ``data.tokenizer=auto``
made concrete (the model folder's own tokenizer, else the byte tokenizer, refused for a pretrained model made for
another tokenizer)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import numpy as np

from meshtron.data.hub import is_hub_id, local_folder, shown_name
from meshtron.errors import ConfigError


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 is end-of-sequence."""

    name = "byte"
    vocab_size = 257
    eos_token_id = 256

    def describe(self) -> str:
        return f"{self.name} ({self.vocab_size})"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        arr = arr[(arr >= 0) & (arr < 256)]
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


AUTO = "auto"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""The files that make a folder a tokenizer's: the fast tokenizer, its config, a SentencePiece model, or the vocabulary
of a BPE (vocab.json + merges.txt) or WordPiece (vocab.txt) tokenizer."""


class HFTokenizer:
    """A local Hugging Face tokenizer directory, loaded without network access."""

    def __init__(self, path: str, trust_remote_code: bool = False, setting: str = "data.tokenizer"):
        from transformers import AutoTokenizer

        self.name = str(Path(path).expanduser().resolve())
        try:
            self.tok = AutoTokenizer.from_pretrained(
                self.name, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception as err:  # noqa: BLE001 - surface any loader failure as a config error
            raise ConfigError(
                f"{setting}: could not load a Hugging Face tokenizer from '{self.name}' ({err}); "
                "point data.tokenizer at a directory with tokenizer.json / tokenizer_config.json, or use 'byte'"
            ) from None
        if self.tok.eos_token_id is None:
            raise ConfigError(
                f"{setting}: the tokenizer in '{self.name}' has no EOS token; "
                "set eos_token in its tokenizer_config.json or use data.tokenizer=byte"
            )
        self.eos_token_id = int(self.tok.eos_token_id)
        self.vocab_size = len(self.tok)

    def describe(self) -> str:
        """The folder (a hub id's as ``org/name@commit``) and its vocabulary size, for the start-up line."""
        return f"{shown_name(self.name)} ({self.vocab_size:,})"

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


def has_tokenizer(directory: str | os.PathLike | None) -> bool:
    """Whether ``directory`` (a model folder, say) holds a tokenizer: one of ``TOKENIZER_FILES``."""
    if not directory:
        return False
    folder = Path(directory).expanduser()
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


BYTE_MODEL_VOCAB = -(-ByteTokenizer.vocab_size // 64) * 64
"""The most ids a model made for the byte tokenizer has: a preset pads the vocabulary to a multiple of 64 (320), so
a meshtron model trained on bytes and exported has that many; a pretrained model with more was made for a tokenizer
of its own."""


def model_vocab_size(model_dir: str | os.PathLike) -> int | None:
    """``vocab_size`` in the model folder's config.json (or its ``text_config``), None where it has none."""
    import json

    try:
        config = json.loads((Path(model_dir).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the model's own loading says what is wrong with its folder
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def check_byte_fallback(spec: str, model_dir: str | os.PathLike | None) -> None:
    """Refuse ``data.tokenizer=auto`` falling back to bytes for a pretrained model made for another tokenizer (more
    than ``BYTE_MODEL_VOCAB`` ids): its embeddings would be trained on ids that mean something else. For the commands
    that start training on new data (train, data prepare), not for those that read a checkpoint."""
    if spec != AUTO or not model_dir or has_tokenizer(model_dir):
        return
    size = model_vocab_size(model_dir)
    if size is not None and size > BYTE_MODEL_VOCAB:
        raise ConfigError(
            f"data.tokenizer=auto: {model_dir} has no tokenizer and its model has {size:,} ids, not the byte "
            f"tokenizer's {ByteTokenizer.vocab_size}; point data.tokenizer at the model's tokenizer folder or hub id, "
            "or set data.tokenizer=byte to train it on bytes on purpose"
        )


def resolve_tokenizer(spec: str, model_dir: str | os.PathLike | None) -> str:
    """``data.tokenizer`` as it is loaded: ``auto`` is ``model_dir`` (``model.name_or_path``) when that folder has a
    tokenizer, else ``byte``; any other value is itself."""
    if spec != AUTO:
        return spec
    return str(model_dir) if has_tokenizer(model_dir) else "byte"


def tokenizer_notice(spec: str, model_dir: str | os.PathLike | None) -> str | None:
    """One line for the user (rank 0) when a pretrained model trains on byte ids: ``auto`` found no tokenizer in its
    folder, or ``data.tokenizer=byte`` was set; None otherwise."""
    if not model_dir:
        return None
    ids = f"the byte tokenizer's {ByteTokenizer.vocab_size} ids"
    if spec == AUTO and not has_tokenizer(model_dir):
        return (
            f"meshtron: data.tokenizer=auto: {model_dir} has no tokenizer; using {ids}; "
            "set data.tokenizer=DIR to use another"
        )
    if spec == "byte":
        fix = (
            "leave data.tokenizer out (auto) to use the model's own"
            if has_tokenizer(model_dir)
            else "set data.tokenizer=DIR to the model's tokenizer folder"
        )
        return f"meshtron: warning: data.tokenizer=byte with model.name_or_path={model_dir}: using {ids}; {fix}"
    return None


def load_tokenizer(
    spec: str, trust_remote_code: bool = False, model_dir: str | os.PathLike | None = None
) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` gives the ByteTokenizer; ``"auto"`` the tokenizer of ``model_dir`` (``model.name_or_path`` as a local
    folder: ``meshtron.data.hub.model_folder``) when it has one, else the ByteTokenizer (``check_byte_fallback`` refuses
    that for a model made for another tokenizer); anything else must be a local tokenizer directory or a hub id (its
    ``main``, from the Hugging Face cache or fetched)."""
    if spec == AUTO:
        if model_dir and not Path(model_dir).expanduser().is_dir():
            raise ConfigError(
                f"model.name_or_path: '{model_dir}' is not an existing directory (data.tokenizer=auto looks for the "
                "model's tokenizer there); give a local Hugging Face model directory"
            )
        resolved = resolve_tokenizer(spec, model_dir)
        if resolved == "byte":
            return ByteTokenizer()
        setting = f"data.tokenizer=auto (the tokenizer of model.name_or_path={model_dir})"
        return HFTokenizer(resolved, trust_remote_code=trust_remote_code, setting=setting)
    if spec == "byte":
        return ByteTokenizer()
    if is_hub_id(spec):
        return HFTokenizer(local_folder(spec, None, trust_remote_code, "data.tokenizer"), trust_remote_code)
    if not os.path.isdir(os.path.expanduser(spec)):
        raise ConfigError(
            f"data.tokenizer: '{spec}' is not 'auto', 'byte', an existing tokenizer directory nor a hub id (org/name); "
            "set data.tokenizer=auto, byte, a local Hugging Face tokenizer folder or a hub id"
        )
    return HFTokenizer(spec, trust_remote_code=trust_remote_code)
