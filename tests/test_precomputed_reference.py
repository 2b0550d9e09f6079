"""The precomputed reference (``preference.reference=precomputed``, meshtron.train.preference.precomputed): a DPO run
with the reference's log-probabilities computed before its first step and stored with the run trains exactly as one
with the live ``model`` reference, single process and over pp2 x dp2 ranks; a resume under another layout reads the
stored file and continues exactly; a file made for other rows is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_layouts
from preference_fixture import write_preference_jsonl

STEPS = 4
"""Optimizer steps of each run; checkpoints after steps 2 and 4."""
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def settings(data: Path) -> list[str]:
    """DPO on 32 pairs (26 trained, 6 held out: neither a multiple of the global batch of 4), 4 steps."""
    return [
        "model.preset=llama-tiny",
        "train.objective=dpo",
        "data.format=preference",
        f"data.path={data}",
        "data.seq_len=64",
        f"train.steps={STEPS}",
        "train.global_batch_size=4",
        "optimizer.lr=3e-3",
        "eval.holdout_documents=6",
        "eval.interval=2",
        "checkpoint.interval=2",
    ]


def in_process(data: Path, out: Path, *overrides: str):
    """One training run in this process (one rank, no process group)."""
    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    cfg = load_config(None, settings(data) + list(overrides) + [f"run.output_dir={out}"], env={})
    return train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))


def rows(run: Path) -> dict[int, dict]:
    """The last metrics row of each step (evaluations merged into their step's row)."""
    merged: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        merged.setdefault(row["step"], {}).update(row)
    return merged


def assert_same_figures(
    found: dict[int, dict], expected: dict[int, dict], steps, rel: float = 1e-6, tiny: float = 1e-7
) -> None:
    """Each figure within ``rel``; ``tiny``: how far apart rewards near 0 may be (beta x a difference of two sums of
    log-probabilities of ~-30, each to float32's ~2e-6 when summed in another order)."""
    for step in steps:
        for name in COMPARED + tuple(f"eval_{n}" for n in COMPARED if n != "loss") + ("eval_loss",):
            if name.startswith("eval_") and "eval_loss" not in expected[step]:
                continue
            assert found[step][name] == pytest.approx(expected[step][name], rel=rel, abs=tiny), (step, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The live-reference run and the precomputed one in this process, and the precomputed one over pp2 x dp2."""
    out = tmp_path_factory.mktemp("precomputed")
    data = out / "pairs.jsonl"
    write_preference_jsonl(data, 32, "alphabet")
    in_process(data, out / "live", "preference.reference=model")
    in_process(data, out / "precomputed", "preference.reference=precomputed")
    layouts = {
        "pp2_dp2_dpo_precomputed": [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "train.micro_batch_size=1",
            "preference.reference=precomputed",
        ]
    }
    run_layouts(4, settings(data), layouts, out)
    return out


def test_precomputed_reference_trains_as_the_live_reference(runs):
    """Every step's loss, rewards and log-probabilities, and each evaluation's, as with the live reference (which
    fails if the reference's log-probabilities were not read with the rows: the policy's own at step 1 give zero
    rewards and then drift), and the stored file holds the training and held-out rows."""
    live = rows(runs / "live")
    assert_same_figures(rows(runs / "precomputed"), live, range(1, STEPS + 1))
    assert abs(live[1]["logps/chosen"]) > 1  # a reference of zeros would give large rewards
    from meshtron.data.reference_logps import FILE_NAME

    with np.load(runs / "precomputed" / FILE_NAME) as stored:
        assert stored["train"].shape == (26, 2) and stored["evaluation"].shape == (6, 2)
        assert np.all(stored["train"] < 0)


def test_precomputed_over_pipeline_and_data_parallel_ranks_equals_one_process(runs):
    """pp2 x dp2, one pair per pipeline microbatch: computed on the last stages of both data-parallel ranks, gathered
    on every rank, the same file (to float32's last bits) and the same run as one process with the live reference."""
    assert_same_figures(rows(runs / "pp2_dp2_dpo_precomputed"), rows(runs / "live"), range(1, STEPS + 1), 1e-5, 1e-6)
    from meshtron.data.reference_logps import FILE_NAME

    with (
        np.load(runs / "pp2_dp2_dpo_precomputed" / FILE_NAME) as found,
        np.load(runs / "precomputed" / FILE_NAME) as expected,
    ):
        for name in ("train", "evaluation"):
            np.testing.assert_allclose(found[name], expected[name], rtol=1e-5)


def test_a_resume_under_another_layout_reads_the_stored_log_probabilities(runs, tmp_path):
    """The pp2 x dp2 run resumed in one process from its step-2 checkpoint: it reads the stored file (it cannot
    compute them again: its weights are no longer the starting ones) and its steps 3 and 4 are the run's."""
    from meshtron.data.reference_logps import FILE_NAME

    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "pp2_dp2_dpo_precomputed", resumed)
    checkpoint = resumed / "checkpoints" / f"step-{2:08d}"
    in_process(runs / "pairs.jsonl", resumed, "preference.reference=precomputed", f"checkpoint.resume={checkpoint}")
    assert_same_figures(rows(resumed), rows(runs / "pp2_dp2_dpo_precomputed"), (3, 4), 1e-5, 1e-6)

    (resumed / FILE_NAME).unlink()
    from meshtron.errors import MeshtronError

    with pytest.raises(MeshtronError, match=f"{FILE_NAME} is missing, and this run resumes from a checkpoint") as err:
        in_process(runs / "pairs.jsonl", resumed, "preference.reference=precomputed", f"checkpoint.resume={checkpoint}")
    assert "\n" not in str(err.value)


def test_a_file_computed_for_other_rows_is_refused_in_one_line(runs, tmp_path):
    """The run's directory holds the file of other pairs: refused before any step, naming what differs."""
    from meshtron.data.reference_logps import FILE_NAME
    from meshtron.errors import MeshtronError

    other = tmp_path / "other.jsonl"
    write_preference_jsonl(other, 32, "alphabet", seed=1)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(runs / "precomputed" / FILE_NAME, run / FILE_NAME)
    with pytest.raises(MeshtronError, match=r"computed for eval_rows_checksum='[0-9a-f]+', but this run has") as err:
        in_process(other, run, "preference.reference=precomputed", "checkpoint.resume=none")
    assert "\n" not in str(err.value) and "delete it" in str(err.value)


def test_the_file_reads_back_only_for_its_identity(tmp_path):
    from meshtron.data.reference_logps import ReferenceLogps, load_reference_logps, reference_identity
    from meshtron.errors import MeshtronError

    identity = reference_identity({"preset": "llama-tiny"}, 0, (3, "abc"), None)
    logps = ReferenceLogps(np.array([[-1.5, -2.0], [-3.0, -4.25], [-0.5, -9.0]]), None, identity)
    path = tmp_path / "reference_logps.npz"
    logps.save(path)
    assert not list(tmp_path.glob(".*partial"))
    read = load_reference_logps(path, identity)
    np.testing.assert_array_equal(read.train, logps.train)
    assert read.evaluation is None
    with pytest.raises(MeshtronError, match=r"computed for seed=0, but this run has seed=1;"):
        load_reference_logps(path, reference_identity({"preset": "llama-tiny"}, 1, (3, "abc"), None))
