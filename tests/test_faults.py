"""Fault handling pieces that need no processes: the test-only fault spec, the restart bookkeeping and a
checkpoint's file list (the multi-process restart and damaged-checkpoint runs are in test_checkpoint.py)."""

from __future__ import annotations

import json

import pytest

from meshtron.checkpoint.integrity import damage, file_manifest
from meshtron.errors import ConfigError
from meshtron.train.faults import Fault, fault_from_env
from meshtron.train.restart import last_logged_step, restart_count, restart_message


def test_fault_spec_parses_and_bad_ones_name_the_format():
    assert fault_from_env({}) is None
    assert fault_from_env({"MESHTRON_FAULT": "kill:step=6:rank=2"}) == Fault("kill", 6, 2)
    for bad in ("explode:step=1:rank=0", "kill:step=x:rank=0", "kill:rank=0"):
        with pytest.raises(ConfigError, match="kind:step=S:rank=R"):
            fault_from_env({"MESHTRON_FAULT": bad})


def test_a_restarted_attempt_never_injects_again(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_count() == 1
    Fault("kill", 3, 0).before_step(3, 0)  # would SIGKILL this test on a first start


def test_restart_bookkeeping(tmp_path):
    assert last_logged_step(tmp_path) == 0
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo'  # cut short
    )
    assert last_logged_step(tmp_path) == 3
    line = restart_message(1, tmp_path / "step-00000002", 2, 3)
    assert "restart 1 of this run" in line and "resumed from step-00000002 (step 2); 1 step(s)" in line
    assert "no checkpoint yet: starting over; 3 step(s)" in restart_message(2, None, 0, 3)


def test_file_list_finds_missing_and_truncated_files(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"x" * 10)
    (tmp_path / "__0_0.distcp").write_bytes(b"y" * 100)
    (tmp_path / "meshtron.json").write_text(json.dumps({"step": 2, "files": file_manifest(tmp_path)}))
    assert json.loads((tmp_path / "meshtron.json").read_text())["files"] == {".metadata": 10, "__0_0.distcp": 100}
    assert damage(tmp_path) is None
    (tmp_path / "__0_0.distcp").write_bytes(b"y" * 60)
    assert damage(tmp_path) == "__0_0.distcp has 60 bytes, 100 when saved"
    (tmp_path / "__0_0.distcp").unlink()
    assert damage(tmp_path) == "__0_0.distcp is missing"
    (tmp_path / "meshtron.json").write_text("{")
    assert damage(tmp_path).startswith("meshtron.json is unreadable")
    assert damage(tmp_path / "nowhere") == "the folder does not exist"
