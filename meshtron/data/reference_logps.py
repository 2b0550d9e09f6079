"""Precomputed reference log-probabilities (``preference.reference=precomputed``; docs/post-training.md): per pair
(row) of the preference data, the summed log-probabilities of its chosen and rejected answers under the policy's
starting weights, computed once before the first step (meshtron.train.preference.precomputed) and kept with the run
as ``<run.output_dir>/reference_logps.npz``: plain numbers, read with the rows (PreferenceDataset.reference_rows).

The file holds the training rows' ``(N, 2)`` array, the evaluation rows' (if any) and what identifies them: the rows'
count and checksum, the model and the seed. A run that finds the file reuses it when all of that agrees (a resume
under any layout, or a new start on the same data) and refuses it in one line when it does not.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtron.errors import MeshtronError

FILE_NAME = "reference_logps.npz"


@dataclass(frozen=True)
class ReferenceLogps:
    """The reference's (rows, 2) float64 log-probabilities of the training and evaluation rows, and ``identity``:
    what they were computed from (``reference_identity``)."""

    train: np.ndarray
    evaluation: np.ndarray | None
    identity: dict

    def save(self, path: Path) -> None:
        """Write ``path`` atomically (a partial file never has its name)."""
        arrays = {"train": self.train, "identity": np.array(json.dumps(self.identity, sort_keys=True))}
        if self.evaluation is not None:
            arrays["evaluation"] = self.evaluation
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as file:
            np.savez(file, **arrays)
        os.replace(partial, path)


def reference_identity(model: dict, seed: int, train_rows: tuple[int, str], eval_rows: tuple[int, str] | None) -> dict:
    """What a file's log-probabilities depend on: ``model`` (the settings that make the starting weights), the seed
    that initializes them, and each dataset's (row count, checksum)."""
    identity = {"model": model, "seed": seed, "rows": train_rows[0], "rows_checksum": train_rows[1]}
    if eval_rows is not None:
        identity.update(eval_rows=eval_rows[0], eval_rows_checksum=eval_rows[1])
    return json.loads(json.dumps(identity, sort_keys=True))  # as it reads back from the file


def load_reference_logps(path: Path, identity: dict) -> ReferenceLogps:
    """The file at ``path``, if it was computed for ``identity``; a one-line MeshtronError if not."""
    with np.load(path, allow_pickle=False) as stored:
        found = json.loads(str(stored["identity"]))
        train = stored["train"]
        evaluation = stored["evaluation"] if "evaluation" in stored else None
    differing = [key for key in sorted(set(identity) | set(found)) if identity.get(key) != found.get(key)]
    if differing:
        key = differing[0]
        raise MeshtronError(
            f"{path} holds reference log-probabilities computed for {key}={found.get(key)!r}, but this run has "
            f"{key}={identity.get(key)!r}; delete it to compute them again from the starting weights, or use another "
            "run.output_dir"
        )
    return ReferenceLogps(train, evaluation, identity)
