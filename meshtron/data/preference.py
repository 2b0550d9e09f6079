"""Preference data (``data.format=preference``): pairs of answers to one prompt, ``chosen`` and ``rejected``, for
the preference objectives (``train.objective`` dpo, ipo, simpo, orpo; docs/post-training.md#data).

Each record of a ``.jsonl`` file or a saved ``datasets`` folder holds ``prompt``, ``chosen`` and ``rejected`` in one
of TRL's forms: plain strings (EOS appended to each answer, as TRL's ``add_eos``), or conversations (lists of
``{"role", "content"}`` messages rendered with the tokenizer's chat template, the prompt with the generation prompt),
including the implicit-prompt form without ``prompt`` (``chosen`` and ``rejected`` whole conversations sharing a
beginning, split as TRL's ``extract_prompt``). The token ids of each sequence are TRL 1.16's: DPOTrainer's
``tokenize_fn`` (the answer starts where the tokenized prompt and prompt + answer diverge), then
DataCollatorForPreference's cut of each sequence to ``preference.max_length`` tokens (``truncation_mode``); a pair
whose prompt alone fills ``max_length`` under ``keep_start`` is left out, as TRL drops it (counted in
``PreferenceDataset.describe``, the data's part of the start-up line), and so is a pair whose ``chosen`` equals its
``rejected`` (nothing to prefer).

The row of a pair (``data.seq_len + 1`` tokens): prompt + chosen, a separator token, prompt + rejected, a separator
token, then separator padding. Labels are set only where the target is an answer's token of the same sequence (TRL's
completion mask, shifted: a sequence's first token and the separators are never targets), so each row's labels form
two runs, the chosen answer's and then the rejected answer's. With ``prompt_nll`` (ORPO, whose NLL term TRL takes
over the chosen sequence's prompt and answer) the chosen sequence's prompt targets carry a label of their own below
IGNORE_INDEX (meshtron.data.labels.NLL_ONLY_LABELS_BELOW) that only the NLL term counts. The separator is where
document masks cut (``data.mask_documents``, required), so the rejected sequence sees nothing of the chosen one and
its positions restart at 0, as TRL's separate rows do: EOS when no sequence contains it, else a token none contains
(plain answers end with EOS, so usually not EOS). The rows are built in memory at the start, on every rank
(fine-tuning sets).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from meshtron.config import DataConfig, PreferenceConfig
from meshtron.data.chat import ROLES, _json_lines
from meshtron.data.labels import IGNORE_INDEX, NLL_ONLY_LABELS_BELOW
from meshtron.data.sources import _is_saved_dataset, _load_saved, utf8_only
from meshtron.errors import ConfigError, MeshtronError


def resolved_max_length(seq_len: int, max_length: int | None) -> int:
    """``preference.max_length``, unset: the longest sequence of which two, each with its separator, fit a row."""
    return (seq_len + 1) // 2 - 1 if max_length is None else max_length


def check_preference_settings(data: DataConfig, preference: PreferenceConfig) -> None:
    """What preflight refuses of preference data's settings, before any collective work."""
    if not data.mask_documents:
        raise ConfigError(
            "data.format=preference needs data.mask_documents=true: a pair's chosen and rejected sequences share "
            "a row, and the document mask keeps each from seeing the other; remove data.mask_documents=false"
        )
    max_length = resolved_max_length(data.seq_len, preference.max_length)
    if max_length < 1 or 2 * (max_length + 1) > data.seq_len + 1:
        raise ConfigError(
            f"preference.max_length={max_length} does not fit data.seq_len={data.seq_len}: a row of data.seq_len + 1 "
            f"tokens holds a pair's two sequences and a separator after each, 2 x (max_length + 1) tokens; set "
            f"data.seq_len to at least {2 * max(max_length, 1) + 1} or preference.max_length to at most "
            f"{(data.seq_len + 1) // 2 - 1} (or leave it unset)"
        )


def check_preference_tokenizer(tokenizer) -> None:
    """Conversations need a fast Hugging Face tokenizer with a chat template (as data.format=chat)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None or not getattr(tok, "chat_template", None):
        raise ConfigError(
            "data.format=preference with conversations renders them with the tokenizer's chat template: set "
            "data.tokenizer to a Hugging Face tokenizer folder that has one (tokenizer_config.json 'chat_template'), "
            "or give plain strings"
        )
    if not tok.is_fast:
        raise ConfigError(f"data.format=preference needs a fast tokenizer (tokenizer.json) in '{tokenizer.name}'")


def iter_records(path: str, max_documents: int | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) of a ``.jsonl`` file (``file:line``) or a saved ``datasets`` folder (``folder[i]``), in
    order, at most ``max_documents`` of them."""
    local = Path(path).expanduser()
    rows: Iterator[tuple[str, object]]
    if _is_saved_dataset(local):
        rows = ((f"{local}[{i}]", row) for i, row in enumerate(_load_saved(local)))
    elif local.is_file():
        rows = utf8_only(local, _json_lines(local), reads="preference pairs: a UTF-8 .jsonl file or a saved dataset")
    else:
        raise ConfigError(
            f"data.path: '{path}' is not a .jsonl file or a saved dataset; data.format=preference reads those"
        )
    for count, (where, row) in enumerate(rows):
        if max_documents is not None and count >= max_documents:
            return
        if not isinstance(row, dict):
            raise ConfigError(f"data.path: {where} is not a record with prompt, chosen and rejected")
        yield where, row


def _check_conversation(value, field: str, where: str) -> None:
    if not value or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        raise ConfigError(
            f'data.path: {where}: \'{field}\' must be a non-empty list of {{"role": ..., "content": ...}} messages '
            "(or every field a plain string); fix the record"
        )
    for number, message in enumerate(value, 1):
        if message["role"] not in ROLES:
            raise ConfigError(
                f"data.path: {where}: '{field}' message {number} has role '{message['role']}', not one of "
                f"{', '.join(ROLES)}; rename it in the data"
            )


def extract_prompt(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) of an implicit-prompt pair, exactly as TRL's ``trl.data_utils.extract_prompt``
    (its quirk included: when one conversation is a beginning of the other, the last shared message stays in the
    answers)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # TRL's check for strings; never true of messages
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def record_fields(record: dict, where: str) -> tuple[object, object, object]:
    """(prompt, chosen, rejected) of a record, checked: both answers, and a prompt unless they are conversations
    (then the implicit prompt is extracted); all plain strings or all conversations."""
    for field in ("chosen", "rejected"):
        if field not in record:
            raise ConfigError(
                f"data.path: {where} has no '{field}'; each record needs prompt, chosen and rejected (or chosen and "
                "rejected as whole conversations)"
            )
    chosen, rejected = record["chosen"], record["rejected"]
    conversational = isinstance(chosen, list)
    present = ("prompt", "chosen", "rejected") if "prompt" in record else ("chosen", "rejected")
    for field in present:
        value = record[field]
        if conversational:
            if field == "prompt" and value == []:
                continue
            _check_conversation(value, field, where)
        elif not isinstance(value, str):
            raise ConfigError(
                f"data.path: {where}: '{field}' is a {type(value).__name__}; give prompt, chosen and rejected all as "
                "plain strings or all as lists of messages"
            )
    if "prompt" not in record:
        if not conversational:
            raise ConfigError(
                f"data.path: {where} has no 'prompt'; plain-string chosen and rejected need one (an implicit prompt "
                "is read from conversations only)"
            )
        return extract_prompt(chosen, rejected)
    return record["prompt"], chosen, rejected


@dataclass
class Pair:
    """One pair's token ids as TRL's DPOTrainer ``tokenize_fn`` makes them (before truncation)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def _common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def _plain_ids(tokenizer, text: str) -> list[int]:
    tok = getattr(tokenizer, "tok", None)
    if tok is None:  # the byte tokenizer: no special tokens around a text
        return [int(i) for i in tokenizer.encode(text)]
    return list(tok(text=text)["input_ids"])


def _plain_sequence_ids(tokenizer, prompt: str, answer: str) -> list[int]:
    """prompt + answer tokenized whole, the answer ended by EOS as TRL's ``add_eos`` ends it (its text appended
    unless the answer ends with it; the byte tokenizer, which has no text for EOS, gets its id appended)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        return _plain_ids(tokenizer, prompt + answer) + [int(tokenizer.eos_token_id)]
    if not answer.endswith(tok.eos_token):
        answer += tok.eos_token
    return _plain_ids(tokenizer, prompt + answer)


def _template_ids(tokenizer, messages: list, add_generation_prompt: bool = False) -> list[int]:
    encoded = tokenizer.tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, tools=None, add_generation_prompt=add_generation_prompt
    )
    return list(encoded["input_ids"])


def tokenize_pair(tokenizer, prompt, chosen, rejected) -> Pair:
    """TRL 1.16's DPOTrainer ``tokenize_fn``: prompt, prompt + chosen and prompt + rejected tokenized whole; the
    answers start where the prompt's ids and both sequences' stop agreeing (``common_prefix_length``)."""
    if isinstance(chosen, list):
        prompt_ids = _template_ids(tokenizer, prompt, add_generation_prompt=True)
        chosen_full = _template_ids(tokenizer, prompt + chosen)
        rejected_full = _template_ids(tokenizer, prompt + rejected)
    else:
        prompt_ids = _plain_ids(tokenizer, prompt)
        chosen_full = _plain_sequence_ids(tokenizer, prompt, chosen)
        rejected_full = _plain_sequence_ids(tokenizer, prompt, rejected)
    shared = min(_common_prefix_length(prompt_ids, chosen_full), _common_prefix_length(prompt_ids, rejected_full))
    return Pair(prompt_ids[:shared], chosen_full[shared:], rejected_full[shared:])


def truncated(prompt_ids: list[int], answer_ids: list[int], max_length: int, mode: str) -> tuple[list[int], list[int]]:
    """(ids, completion mask) of prompt + answer cut to ``max_length`` as TRL's DataCollatorForPreference does."""
    ids = prompt_ids + answer_ids
    mask = [0] * len(prompt_ids) + [1] * len(answer_ids)
    cut = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    return ids[cut], mask[cut]


def pair_row(
    chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]], separator: int, width: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, trained, where the rejected sequence starts) of one pair's row of ``width`` tokens: each sequence
    followed by ``separator``; trained marks the answers' tokens but each sequence's first (never a target)."""
    tokens: np.ndarray = np.full(width, separator, dtype=np.int64)
    trained: np.ndarray = np.zeros(width, dtype=bool)
    start = 0
    for ids, mask in (chosen, rejected):
        tokens[start : start + len(ids)] = ids
        trained[start : start + len(ids)] = np.asarray(mask, dtype=bool)
        trained[start] = False
        start += len(ids) + 1
    return tokens, trained, len(chosen[0]) + 1


def choose_separator(tokenizer, pairs: list[Pair]) -> int:
    """The token after each sequence, where document masks cut: EOS when no sequence uses it, else the pad or BOS
    token, else the highest id none uses (as meshtron.data.chat.choose_separator)."""
    used: set[int] = set()
    for pair in pairs:
        used.update(pair.prompt_ids, pair.chosen_ids, pair.rejected_ids)
    tok = getattr(tokenizer, "tok", None)
    candidates = [tokenizer.eos_token_id] + ([tok.pad_token_id, tok.bos_token_id] if tok is not None else [])
    for candidate in candidates:
        if candidate is not None and candidate not in used:
            return int(candidate)
    for candidate in range(tokenizer.vocab_size - 1, -1, -1):
        if candidate not in used:
            return candidate
    raise MeshtronError("the preference pairs use every token of the vocabulary; no token is left to separate them")


@dataclass
class ReadPairs:
    """The usable pairs of a source, tokenized, and what was left out of it."""

    pairs: list[Pair]
    identical: int = 0
    """Records whose chosen equals their rejected (skipped)."""
    prompt_too_long: int = 0
    """Pairs whose prompt alone fills ``max_length`` under ``keep_start`` (dropped, as TRL does)."""


def read_pairs(data: DataConfig, tokenizer, max_length: int, truncation_mode: str) -> ReadPairs:
    """The pairs of ``data.path`` tokenized as TRL does, each bad record refused in one line naming it."""
    read = ReadPairs([])
    checked_template = False
    for where, record in iter_records(data.path, data.max_documents):
        prompt, chosen, rejected = record_fields(record, where)
        if chosen == rejected:
            read.identical += 1
            continue
        if isinstance(chosen, list) and not checked_template:
            check_preference_tokenizer(tokenizer)
            checked_template = True
        for field, answer in (("chosen", chosen), ("rejected", rejected)):
            if answer == "":
                raise ConfigError(f"data.path: {where}: '{field}' is empty; give every pair two answers")
        pair = tokenize_pair(tokenizer, prompt, chosen, rejected)
        for field, ids in (("chosen", pair.chosen_ids), ("rejected", pair.rejected_ids)):
            if not ids:
                raise ConfigError(
                    f"data.path: {where}: '{field}' has no token of its own after tokenization (the prompt's "
                    "tokens cover it); give it an answer"
                )
        if truncation_mode == "keep_start" and len(pair.prompt_ids) >= max_length:
            read.prompt_too_long += 1
            continue
        read.pairs.append(pair)
    return read


class PreferenceDataset:
    """One pair a row (see the module docstring): ``rows`` the tokens, ``batch`` the inputs and labels
    (IGNORE_INDEX but on the answers' tokens); the TrainingDataset protocol of meshtron.data.training_data."""

    def __init__(
        self,
        tokens: np.ndarray,
        trained: np.ndarray,
        chosen_end: np.ndarray,
        separator: int,
        max_length: int,
        *,
        identical: int = 0,
        prompt_too_long: int = 0,
        truncated: int = 0,
        chosen_prompt: np.ndarray | None = None,
        prompt_nll: bool = False,
    ):
        self.tokens, self.trained = tokens, trained
        self.chosen_end = chosen_end
        """Per row, where the rejected sequence starts (one past the chosen sequence's separator)."""
        self.separator = separator
        """The token after each sequence (and the padding): where document masks cut (see choose_separator)."""
        self.seq_len = tokens.shape[1] - 1
        self.max_length = max_length
        self.identical, self.prompt_too_long, self.truncated = identical, prompt_too_long, truncated
        self.chosen_prompt = np.zeros_like(trained) if chosen_prompt is None else chosen_prompt
        """Per row, the chosen sequence's prompt tokens but its first (the targets of TRL's ORPO NLL besides the
        chosen answer's)."""
        self.prompt_nll = prompt_nll
        """Whether ``batch`` labels the ``chosen_prompt`` targets for the NLL term (NLL_ONLY_LABELS_BELOW) and
        ``chosen_token_count`` counts them (``train.objective=orpo``)."""
        self.reference_logps: np.ndarray | None = None
        """With ``preference.reference=precomputed``: each row's (chosen, rejected) reference log-probabilities,
        float64 (meshtron.data.reference_logps; set by ``attach_reference``)."""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, indices) -> np.ndarray:
        return self.tokens[_indices(indices)]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels): the row's first ``seq_len`` tokens, and its last where an answer's token is the
        target, IGNORE_INDEX elsewhere (with ``prompt_nll``: the chosen prompt's targets marked for the NLL term)."""
        indices = _indices(indices)
        rows, trained = self.tokens[indices], self.trained[indices]
        labels = np.where(trained[:, 1:], rows[:, 1:], IGNORE_INDEX)
        if self.prompt_nll:
            nll_only = NLL_ONLY_LABELS_BELOW - 1 - rows[:, 1:]
            labels = np.where(self.chosen_prompt[indices, 1:], nll_only, labels)
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(labels)

    def attach_reference(self, logps: np.ndarray) -> None:
        """Read the reference's log-probabilities ``logps`` (rows, 2) with the rows from now on."""
        if logps.shape != (len(self), 2):
            raise MeshtronError(
                f"reference log-probabilities of shape {logps.shape} for {len(self)} preference pairs; compute them "
                "again (delete the run's reference_logps.npz)"
            )
        self.reference_logps = np.asarray(logps, dtype=np.float64)

    def reference_rows(self, indices) -> torch.Tensor:
        """(B, 2) float64: the attached reference log-probabilities of the rows ``indices``."""
        return torch.from_numpy(self.reference_logps[_indices(indices)])

    def checksum(self) -> str:
        """A digest of the rows (their tokens and which carry loss): what precomputed reference log-probabilities
        were computed for."""
        digest = hashlib.sha256()
        for array in (self.tokens, self.trained):
            digest.update(str(array.shape).encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def target_count(self, indices) -> int:
        """Labelled tokens of the rows ``indices``, both answers (every rank counts the global batch itself)."""
        return int(self.trained[_indices(indices), 1:].sum())

    def chosen_token_count(self, indices) -> int:
        """Labelled tokens of the chosen answers of the rows ``indices`` (the denominator of the NLL terms), with
        ``prompt_nll`` also the chosen prompts' targets."""
        indices = _indices(indices)
        before = np.arange(self.tokens.shape[1])[None, :] < self.chosen_end[indices][:, None]
        prompts = int(self.chosen_prompt[indices].sum()) if self.prompt_nll else 0
        return int((self.trained[indices] & before).sum()) + prompts

    def describe(self) -> str:
        left_out = [
            f"{self.identical:,} with chosen == rejected skipped" if self.identical else "",
            f"{self.prompt_too_long:,} whose prompt fills preference.max_length={self.max_length} left out"
            if self.prompt_too_long
            else "",
            f"{self.truncated:,} sequences cut to {self.max_length} tokens" if self.truncated else "",
        ]
        notes = "".join(f", {note}" for note in left_out if note)
        return (
            f"{len(self):,} preference pairs, one a row of {self.seq_len + 1} tokens{notes}, sequences separated by "
            f"token {self.separator}; {int(self.trained[:, 1:].sum()):,} tokens carry loss"
        )


def _indices(indices) -> np.ndarray:
    return np.asarray(indices, dtype=np.int64).reshape(-1)


def chosen_prompt_targets(chosen_mask: list[int], width: int) -> np.ndarray:
    """The positions of a row (``width``) whose target is a prompt token of the chosen sequence (its completion mask
    ``chosen_mask``; the sequence's first token is never a target)."""
    prompt: np.ndarray = np.zeros(width, dtype=bool)
    prompt[: len(chosen_mask)] = np.asarray(chosen_mask, dtype=bool) == 0
    prompt[0] = False
    return prompt


def _check_both_answers_trained(row: int, trained: np.ndarray, chosen_end: int, truncation_mode: str) -> None:
    """Refuse, on every rank while the data is built, a pair one of whose answers kept no target token (a one-token
    answer after an empty prompt, or one cut away): the loss needs a log-probability of each answer."""
    for answer, marks in (("chosen", trained[:chosen_end]), ("rejected", trained[chosen_end:])):
        if not marks.any():
            raise MeshtronError(
                f"data.path: pair {row + 1} (counting usable pairs) keeps no token of its {answer} answer to score "
                f"(an answer of one token after an empty prompt, or cut away by preference.truncation_mode="
                f"{truncation_mode}); give it a prompt, lengthen the answer or raise preference.max_length"
            )


def pack_pairs(
    pairs: list[Pair],
    separator: int,
    width: int,
    max_length: int,
    truncation_mode: str,
    prompt_nll: bool = False,
    **counts: int,
) -> PreferenceDataset:
    """The rows of ``pairs``, each sequence cut to ``max_length`` (TRL's collator); ``prompt_nll``: see
    PreferenceDataset."""
    tokens: np.ndarray = np.full((len(pairs), width), separator, dtype=np.int64)
    trained: np.ndarray = np.zeros((len(pairs), width), dtype=bool)
    chosen_prompt: np.ndarray = np.zeros((len(pairs), width), dtype=bool)
    chosen_end: np.ndarray = np.zeros(len(pairs), dtype=np.int64)
    cut = 0
    for row, pair in enumerate(pairs):
        sequences = []
        for answer in (pair.chosen_ids, pair.rejected_ids):
            cut += len(pair.prompt_ids) + len(answer) > max_length
            sequences.append(truncated(pair.prompt_ids, answer, max_length, truncation_mode))
        tokens[row], trained[row], chosen_end[row] = pair_row(sequences[0], sequences[1], separator, width)
        chosen_prompt[row] = chosen_prompt_targets(sequences[0][1], width)
        _check_both_answers_trained(row, trained[row], int(chosen_end[row]), truncation_mode)
    return PreferenceDataset(
        tokens,
        trained,
        chosen_end,
        separator,
        max_length,
        truncated=cut,
        chosen_prompt=chosen_prompt,
        prompt_nll=prompt_nll,
        **counts,
    )


def build_preference_datasets(
    data: DataConfig,
    preference: PreferenceConfig,
    tokenizer,
    held_out: int = 0,
    separator: int | None = None,
    prompt_nll: bool = False,
) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """(the pairs of ``data.path``, None), or with ``held_out`` (``eval.holdout_documents``) all but the last
    ``held_out`` usable pairs and, apart, those last ones. Both use one separator: ``separator`` when given
    (evaluation data takes the training data's), else one chosen here. ``prompt_nll``: the chosen prompts' targets
    labelled for the NLL term (``train.objective=orpo``; see PreferenceDataset)."""
    check_preference_settings(data, preference)
    max_length = resolved_max_length(data.seq_len, preference.max_length)
    read = read_pairs(data, tokenizer, max_length, preference.truncation_mode)
    if not read.pairs:
        raise MeshtronError(
            f"data.path '{data.path}' has no usable preference pairs ({read.identical} with chosen == rejected, "
            f"{read.prompt_too_long} whose prompt fills preference.max_length={max_length}); check the data"
        )
    if held_out >= len(read.pairs):
        raise ConfigError(
            f"eval.holdout_documents={held_out} leaves nothing to train on: data.path '{data.path}' has "
            f"{len(read.pairs)} usable pairs; hold out fewer or set eval.path"
        )
    if separator is None:
        separator = choose_separator(tokenizer, read.pairs)
    elif _holds_token(read.pairs, separator):
        raise MeshtronError(
            f"data.path '{data.path}' uses token {separator}, which separates the training sequences; evaluate on "
            "pairs without it"
        )
    width, mode = data.seq_len + 1, preference.truncation_mode
    kept = read.pairs[: len(read.pairs) - held_out]
    training = pack_pairs(
        kept,
        separator,
        width,
        max_length,
        mode,
        prompt_nll,
        identical=read.identical,
        prompt_too_long=read.prompt_too_long,
    )
    held = read.pairs[len(kept) :]
    evaluation = pack_pairs(held, separator, width, max_length, mode, prompt_nll) if held_out else None
    return training, evaluation


def _holds_token(pairs: list[Pair], separator: int) -> bool:
    """Whether any sequence of ``pairs`` holds ``separator`` (which would cut it apart)."""
    return any(separator in pair.prompt_ids + pair.chosen_ids + pair.rejected_ids for pair in pairs)
