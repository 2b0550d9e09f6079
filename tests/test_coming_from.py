"""docs/coming-from.md (the Hugging Face Trainer's, axolotl's and torchtitan's options and meshtron's keys) names only
keys that exist: every `section.key` in backticks whose section is one of meshtron's. In-process, no torch work."""

from __future__ import annotations

import re

from conftest import REPO

from meshtron.settings_reference import sections

PAGE = REPO / "docs" / "coming-from.md"
SECTIONS = tuple(sections())
KEYS = frozenset(setting.key for _, settings in sections().values() for setting in settings)
# `section.key`, `section.key=value` or `optimizer.muon.key` in backticks; the peers' names are spelled otherwise
# (`max_grad_norm`, `[training] seq_len`), so any dotted name in one of meshtron's sections is taken for a key.
TOPICS = (
    "accumulation, learning rate, warmup, weight decay, clipping, bf16, fp16, tf32, float8, zero-1, zero-2, zero-3, "
    "shard_grad_op, full_shard, hybrid_shard, cpu_offload, activation checkpointing, torch.compile, lora, packing, "
    "chat, train_on_inputs, sequence length, save_steps, save_total_limit, resume_from_checkpoint, eval_steps, "
    "report_to, logging_steps, seed, no equivalent"
)
KEY_IN_BACKTICKS = re.compile(rf"`((?:{'|'.join(SECTIONS)})\.[A-Za-z_][\w.]*)(?:=[^`]*)?`")


def named_keys(text: str) -> set[str]:
    """Every meshtron key that ``text`` names in backticks."""
    return set(KEY_IN_BACKTICKS.findall(text))


def unknown_keys(text: str) -> list[str]:
    return sorted(named_keys(text) - KEYS)


def test_every_key_the_page_names_exists():
    text = PAGE.read_text()
    assert unknown_keys(text) == [], "docs/coming-from.md names keys meshtron does not have"
    assert len(named_keys(text)) >= 60, "the page should map the peers' options to meshtron's keys"


def test_a_made_up_key_is_caught():
    text = PAGE.read_text() + "\n| `num_train_epochs` | `train.epochs=3` | `optimizer.muon.lr` | `lora.r` |\n"
    assert unknown_keys(text) == ["lora.r", "optimizer.muon.lr", "train.epochs"]


def test_the_sections_the_page_covers():
    """The areas issue 57 asked for each have a heading or a table row."""
    text = PAGE.read_text().lower()
    missing = [topic for topic in TOPICS.split(", ") if topic not in text]
    assert missing == []
