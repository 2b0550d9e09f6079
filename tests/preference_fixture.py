"""Preference sets the tests, the docs and the learning example build themselves: pairs where the chosen answer
follows a rule the rejected one breaks, as JSON lines or a saved ``datasets`` folder, plain strings or conversations.

``alphabet``: the prompt counts a few letters ("count: c d e"), the chosen answer goes on with the next three
(" f g h"), the rejected one breaks the order in one place (" f k h"). ``upper``: the prompt gives a word ("shout:
cat"), the chosen answer is it in capitals (" CAT"), the rejected one is it as it was (" cat"); ``capitals``: the same
with random words of 3 to 5 letters (the example's: held-out pairs are new words).

How fast a tiny model learns them (TRL 1.16's DPOTrainer, tests/chat_fixture.py's two-layer Llama from its random
initialization and its character tokenizer, 400 plain pairs, batch 16, lr 1e-3, beta 0.1, 64 held-out pairs of
another seed; 2026-11-28): ``upper`` has held-out rewards/accuracies 1.0 from step 10 (margin 0.57, 1.01 at step
30); ``alphabet``, which needs the order of the letters, 0.69 / 0.78 / 0.83 at steps 10 / 20 / 30."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np

LETTERS = string.ascii_lowercase
WORDS = "cat dog sun map red cup hat pen box sky fig owl bee ant elk".split()


def _alphabet(rng: np.random.Generator) -> tuple[str, str, str]:
    start = int(rng.integers(0, len(LETTERS) - 6))
    shown = int(rng.integers(2, 4))
    prompt = "count: " + " ".join(LETTERS[start : start + shown])
    follow = list(LETTERS[start + shown : start + shown + 3])
    broken = list(follow)
    place = int(rng.integers(0, 3))
    wrong = [c for c in LETTERS if c != follow[place]]
    broken[place] = wrong[int(rng.integers(0, len(wrong)))]
    return prompt, " ".join(follow), " ".join(broken)


def _upper(rng: np.random.Generator) -> tuple[str, str, str]:
    word = WORDS[int(rng.integers(0, len(WORDS)))]
    return f"shout: {word}", word.upper(), word


def _capitals(rng: np.random.Generator) -> tuple[str, str, str]:
    word = "".join(LETTERS[int(i)] for i in rng.integers(0, len(LETTERS), int(rng.integers(3, 6))))
    return f"shout: {word}", word.upper(), word


RULES = {"alphabet": _alphabet, "upper": _upper, "capitals": _capitals}
"""Each rule: a random (prompt, chosen, rejected) of plain text."""


def preference_records(n: int, rule: str, conversational: bool = False, seed: int = 0) -> list[dict]:
    """``n`` records with prompt, chosen and rejected following ``rule`` (see the module docstring); plain strings
    (each answer starts with a space) or one user and one assistant message each."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        prompt, chosen, rejected = RULES[rule](rng)
        if conversational:
            records.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            records.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return records


def write_preference_jsonl(path: Path, n: int, rule: str, conversational: bool = False, seed: int = 0):
    """``preference_records`` as a ``.jsonl`` file at ``path``; returns ``path``."""
    path = Path(path)
    records = preference_records(n, rule, conversational, seed)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_preference_dataset(folder: Path, n: int, rule: str, conversational: bool = False, seed: int = 0) -> Path:
    """``preference_records`` as a saved ``datasets`` folder (``save_to_disk``); returns ``folder``."""
    from datasets import Dataset

    Dataset.from_list(preference_records(n, rule, conversational, seed)).save_to_disk(str(folder))
    return Path(folder)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "preference"
"""The preference example's data (configs/sft-for-dpo.toml, configs/dpo.toml, docs/post-training.md), made by
``write_example`` (``python tests/preference_fixture.py``) and checked against it by
tests/test_preference_training.py."""


def example_files() -> dict[str, str]:
    """The example's files and their text: 464 ``capitals`` pairs (random words, so the 64 that configs/dpo.toml
    holds out are new ones), and the first 400 as plain text documents (prompt and chosen answer) for the
    fine-tuning that comes first."""
    records = preference_records(464, "capitals", seed=1)
    return {
        "pairs.jsonl": "".join(json.dumps(record) + "\n" for record in records),
        "sft.jsonl": "".join(json.dumps({"text": r["prompt"] + r["chosen"]}) + "\n" for r in records[:400]),
    }


def write_example(folder: Path = EXAMPLE) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in example_files().items():
        (folder / name).write_text(text)


if __name__ == "__main__":
    write_example()
