"""Chat data for fine-tuning (``data.format=chat``): conversations rendered with the tokenizer's chat template, the
loss on the assistant's tokens only (``data.train_on=assistant``) or on every token (``all``).

A conversation is a list of ``{"role", "content"}`` messages (roles: system, user, assistant, tool):
``data.messages_field`` of each JSON line, or of each row of a saved ``datasets`` folder. Its assistant tokens are
found from the template itself: for the i-th message, an assistant's, the text rendered for the messages before it
with the generation prompt ends where its tokens start, and the text rendered through it ends where they stop (its
end-of-turn token included). Tokens are mapped to those characters with the fast tokenizer's offsets. A
conversation none of whose tokens carries loss (no assistant message, or cut before it) is counted in
``ChatDataset.describe``, the data's part of the start-up line.

Packing never cuts a conversation: conversations, each followed by a separator token, fill sequences of
``seq_len + 1`` tokens in order; one that does not fit in what is left of a sequence starts the next, and the rest of
the sequence is separator padding with no loss. A conversation longer than a sequence is cut to one sequence. The
separator is where
document masks (``data.mask_documents``) cut: EOS when no conversation contains it, else a token none contains
(chat templates often end every turn with EOS, which must not cut a conversation apart). The sequences are built in
memory at the start, on every rank (fine-tuning sets; nothing is cached).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from meshtron.config import DataConfig
from meshtron.data.labels import IGNORE_INDEX
from meshtron.data.sources import _is_saved_dataset, _load_saved, utf8_only
from meshtron.errors import ConfigError, MeshtronError


def check_chat_tokenizer(tokenizer) -> None:
    """A chat run needs a Hugging Face fast tokenizer with a chat template."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None or not getattr(tok, "chat_template", None):
        raise ConfigError(
            "data.format=chat renders conversations with the tokenizer's chat template: set "
            "data.tokenizer to a Hugging Face tokenizer folder that has one (tokenizer_config.json "
            "'chat_template')"
        )
    if not tok.is_fast:
        raise ConfigError(f"data.format=chat needs a fast tokenizer (tokenizer.json) in '{tokenizer.name}'")


def iter_conversations(path: str, field: str, max_documents: int | None = None) -> Iterator[list[dict]]:
    """The conversations of a ``.jsonl`` file or a saved ``datasets`` folder, in order."""
    local = Path(path).expanduser()
    if _is_saved_dataset(local):
        rows = ((f"{local}[{i}]", row) for i, row in enumerate(_load_saved(local)))
    elif local.is_file():
        rows = _json_rows(local)
    else:
        raise ConfigError(f"data.path: '{path}' is not a .jsonl file or a saved dataset; data.format=chat reads those")
    count = 0
    for where, row in rows:
        if max_documents is not None and count >= max_documents:
            return
        if not isinstance(row, dict) or field not in row:
            raise ConfigError(f"data.messages_field: '{field}' is not in {where}; set data.messages_field")
        messages = row[field]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ConfigError(f'{where}: \'{field}\' must be a list of {{"role": ..., "content": ...}} messages')
        check_roles(messages, where)
        if messages:
            count += 1
            yield messages


ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversation's messages may have: chat templates know these, and only the assistant's carry loss."""


def check_roles(messages: list[dict], where: str) -> None:
    """Refuse a message whose role is not one of ``ROLES`` (a "bot" would silently get no loss)."""
    for number, message in enumerate(messages, 1):
        if message["role"] not in ROLES:
            raise ConfigError(
                f"data.path: {where}: message {number} has role '{message['role']}', not one of {', '.join(ROLES)}; "
                "rename it in the data"
            )


def _json_rows(path: Path):
    return utf8_only(path, _json_lines(path), reads="conversations: a UTF-8 .jsonl file or a saved dataset")


def _json_lines(path: Path):
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield f"{path}:{number}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"data.path: {path}:{number} is not valid JSON ({err})") from None


def render(tokenizer, messages: list[dict], train_on: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, which of them carry loss) of one conversation (no separator yet)."""
    tok = tokenizer.tok
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = tok.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        stop = tok.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (text.startswith(start) and text.startswith(stop)):
            raise MeshtronError(
                "the chat template does not render a conversation's beginning as the beginning of "
                "the whole; data.train_on=assistant cannot find the assistant's tokens (use "
                "data.train_on=all)"
            )
        spans.append((len(start), len(stop)))
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    starts = np.asarray([offset[0] for offset in encoded["offset_mapping"]], dtype=np.int64).reshape(-1)
    if train_on == "all":
        trained = np.ones(ids.size, dtype=bool)
    else:
        trained = np.zeros(ids.size, dtype=bool)
        for low, high in spans:
            trained |= (starts >= low) & (starts < high)
    return ids, trained


def choose_separator(tokenizer, conversations: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """The token that ends each conversation in a sequence, where document masks cut: EOS when no conversation uses
    it (templates often end turns with it), else the pad or BOS token, else the highest id none of them uses."""
    used = set(np.unique(np.concatenate([ids for ids, _ in conversations])).tolist()) if conversations else set()
    tok = tokenizer.tok
    for candidate in (tokenizer.eos_token_id, tok.pad_token_id, tok.bos_token_id):
        if candidate is not None and candidate not in used:
            return int(candidate)
    for candidate in range(tokenizer.vocab_size - 1, -1, -1):
        if candidate not in used:
            return candidate
    raise MeshtronError("the conversations use every token of the vocabulary; no token is left to separate them")


def pack(
    conversations: list[tuple[np.ndarray, np.ndarray]], width: int, eos: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, trained) packed sequences of ``width`` tokens, each conversation followed by ``eos`` (the separator,
    with no loss) and never split (see the module docstring), and how many conversations were cut to one sequence."""
    sequences, masks, cut = [], [], 0
    tokens: np.ndarray = np.full(width, eos, dtype=np.int64)
    trained: np.ndarray = np.zeros(width, dtype=bool)
    used = 0
    for ids, mask in conversations:
        ids, mask = np.append(ids, eos), np.append(mask, False)
        if ids.size > width:
            ids, mask, cut = ids[:width], mask[:width], cut + 1
        if used + ids.size > width:
            sequences.append(tokens)
            masks.append(trained)
            tokens, trained, used = np.full(width, eos, dtype=np.int64), np.zeros(width, dtype=bool), 0
        tokens[used : used + ids.size], trained[used : used + ids.size] = ids, mask
        used += ids.size
    if used:
        sequences.append(tokens)
        masks.append(trained)
    if not sequences:
        return np.zeros((0, width), dtype=np.int64), np.zeros((0, width), dtype=bool), cut
    return np.stack(sequences), np.stack(masks), cut


def untrained(conversations: list[tuple[np.ndarray, np.ndarray]], width: int) -> int:
    """How many of ``conversations`` carry no loss in sequences of ``width`` tokens (pack cuts longer ones)."""
    return sum(not trained[:width].any() for _, trained in conversations)


class ChatDataset:
    """Packed conversations: ``rows`` gives the tokens, ``batch`` the inputs and the labels, IGNORE_INDEX where a
    token carries no loss (padding, and with ``train_on=assistant`` all but the assistant's tokens)."""

    def __init__(
        self,
        tokens: np.ndarray,
        trained: np.ndarray,
        conversations: int = 0,
        cut: int = 0,
        separator: int | None = None,
        untrained: int = 0,
    ):
        self.tokens, self.trained = tokens, trained
        self.separator = separator
        """The token after each conversation (and the padding): where document masks cut (see choose_separator)."""
        self.seq_len = tokens.shape[1] - 1
        self.conversations, self.cut = conversations, cut
        self.untrained = untrained
        """Conversations with no token that carries loss (no assistant message, or all of it cut away)."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, indices) -> np.ndarray:
        return self.tokens[np.asarray(indices, dtype=np.int64).reshape(-1)]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        rows, trained = self.tokens[indices], self.trained[indices]
        labels = np.where(trained[:, 1:], rows[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(labels)

    def target_count(self, indices) -> int:
        """Tokens that carry loss in the sequences ``indices`` (the global batch: every rank counts it itself)."""
        return int(self.trained[np.asarray(indices, dtype=np.int64).reshape(-1), 1:].sum())

    def describe(self) -> str:
        cut = f", {self.cut:,} cut to one sequence" if self.cut else ""
        untrained = f", {self.untrained:,} with no assistant token (nothing to train on)" if self.untrained else ""
        return (
            f"{len(self):,} sequences of {self.seq_len} tokens packed from {self.conversations:,} conversations"
            f"{cut}{untrained}, separated by token {self.separator}; "
            f"{int(self.trained[:, 1:].sum()):,} tokens carry loss"
        )


def build_chat_dataset(data: DataConfig, tokenizer) -> ChatDataset:
    return build_chat_datasets(data, tokenizer)[0]


def build_chat_datasets(
    data: DataConfig, tokenizer, held_out: int = 0, separator: int | None = None
) -> tuple[ChatDataset, ChatDataset | None]:
    """(the packed conversations of ``data.path``, None), or with ``held_out`` (``eval.holdout_documents``) the
    conversations but the last ``held_out`` and, packed apart, those last ones. Both use one separator: ``separator``
    when given (evaluation data takes the training data's, where document masks cut), else one chosen here."""
    conversations = [
        render(tokenizer, messages, data.train_on)
        for messages in iter_conversations(data.path, data.messages_field, data.max_documents)
    ]
    if not conversations:
        raise MeshtronError(f"data.path '{data.path}' has no conversations; check data.messages_field")
    if held_out >= len(conversations):
        raise ConfigError(
            f"eval.holdout_documents={held_out} leaves nothing to train on: data.path '{data.path}' has "
            f"{len(conversations)} conversations; hold out fewer or set eval.path"
        )
    if separator is None:
        separator = choose_separator(tokenizer, conversations)
    elif any(separator in ids for ids, _ in conversations):
        raise MeshtronError(
            f"data.path '{data.path}' uses token {separator}, which separates the training conversations; "
            "evaluate on conversations without it"
        )
    kept = conversations[: len(conversations) - held_out]
    datasets = []
    for part in (kept, conversations[len(kept) :]) if held_out else (kept,):
        tokens, trained, cut = pack(part, data.seq_len + 1, separator)
        datasets.append(ChatDataset(tokens, trained, len(part), cut, separator, untrained(part, data.seq_len + 1)))
    return datasets[0], datasets[1] if held_out else None
