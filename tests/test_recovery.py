"""Faults in real 2-process runs (FSDP over 2 ranks, gloo, CPU), each compared with one uninterrupted run:
ranks killed at three points and during a sync and an async save, a save that fails, a stop by SIGTERM and
its rerun, a Ctrl-C and a second one, a checkpoint changed in place, and a hung rank. The 4-rank (pp2 x tp2)
kill is in test_checkpoint.py; the pieces without processes in test_faults.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_same_tensors, flip_a_byte, run_cli, worker_env

STEPS = 8
FINAL = f"checkpoints/step-{STEPS:08d}"


def command(cache_dir, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--nproc",
        "2",
        "--model.preset=llama-tiny",
        "--data.max_documents=40",
        "--data.seq_len=32",
        f"--data.cache_dir={cache_dir}",
        f"--train.steps={STEPS}",
        "--train.global_batch_size=8",
        "--optimizer.lr=1e-3",
        "--schedule.warmup_steps=2",
        "--train.seed=7",
        "--run.progress=false",
        "--checkpoint.interval=3",
        f"--run.output_dir={out}",
        *extra,
    ]


def last_losses(out: Path) -> list[float]:
    """The loss of each step as a reader of metrics.jsonl takes it: the last row of the step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = {row["step"]: row["loss"] for row in rows}
    return [last[step] for step in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir) -> Path:
    """The uninterrupted run (checkpoints at steps 3, 6 and 8)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = run_cli(command(cache_dir, out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_kills_and_failed_saves_restart_the_run_which_continues_exactly(straight, tmp_path, cache_dir):
    """One torchrun with `--max-restarts 5`, a fault in each attempt: SIGKILL before the first checkpoint
    (step 2), right after one (step 4, the step-3 checkpoint just written) and between two (step 5); SIGKILL
    during the sync save of step 6 (its partial folder is reported and removed, the run resumes from step 3);
    and a save of step 6 that fails with a full disk (a clear error on every rank, step 3 still loads). Losses
    and final weights equal the uninterrupted run's. (The 4-rank pp2 x tp2 kill: test_checkpoint.py.)"""
    out = tmp_path / "run"
    faults = (
        "kill:step=2:rank=1,kill:step=4:rank=0:attempt=1,kill:step=5:rank=1:attempt=2,"
        "killsave:step=6:rank=1:attempt=3,failsave:step=6:rank=0:attempt=4"
    )
    proc = run_cli(
        [*command(cache_dir, out), "--max-restarts", "5"], env=worker_env(MESHTRON_FAULT=faults), timeout=500
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for line in (
        "restart 1 of this run after a failure: no checkpoint yet: starting over; 1 step(s)",
        "restart 2 of this run after a failure: resumed from step-00000003 (step 3); 0 step(s)",
        "restart 3 of this run after a failure: resumed from step-00000003 (step 3); 1 step(s)",
        "restart 4 of this run after a failure: resumed from step-00000003 (step 3); 3 step(s)",
        "removed step-00000006.partial, a save that did not complete",
        "restart 5 of this run after a failure: resumed from step-00000003 (step 3); 3 step(s)",
    ):
        assert line in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 1, 2, 3, 4, 4, 5, 6, 4, 5, 6, 4, 5, 6, 7, 8]
    assert [row.get("restart", 0) for row in rows] == [0, 1, 1, 1, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 5, 5]
    assert (
        "meshtron: error: saving checkpoint step-00000006.partial failed (rank 0: [Errno 28] No space left on "
        "device (injected)); free disk space, make checkpoint.dir writable or change it (earlier checkpoints are "
        "untouched)" in proc.stderr
    )
    assert last_losses(out) == last_losses(straight)
    assert_same_tensors(out / FINAL, straight / FINAL, tmp_path)


@pytest.mark.slow
def test_sigterm_saves_and_exits_75_and_the_rerun_continues_exactly(straight, tmp_path, cache_dir):
    """SIGTERM to the launcher at step 2 (and again during the save): every rank finishes its step, saves it
    and exits 75. The same command resumes, although rank 1 sees no checkpoint (a stale directory cache: rank 0
    resolves checkpoint.resume=auto for all); here with async saves and a rank killed while the step-6 save is
    being written, which resumes from step 3 by itself. Losses and final weights equal the uninterrupted run's."""
    out = tmp_path / "run"
    stopped = run_cli(command(cache_dir, out), env=worker_env(MESHTRON_FAULT="term:step=2:rank=1"), timeout=300)
    assert stopped.returncode == 75, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    said = re.search(
        r"stopped by SIGTERM after step (\d) of 8: checkpoint step-0000000(\d) saved; run the same "
        r"command again to resume \(exit status 75\)",
        stopped.stdout,
    )
    # The launcher sends the signal on to the workers; on a loaded machine it may reach them a step or two later
    # (every rank still stops after the same step, the one they agree on in a step's all-reduce).
    assert said and said[1] == said[2] and said[1] in "2345", stopped.stdout[-2000:]
    stop = int(said[1])
    assert "sends a second SIGTERM during the save" in stopped.stderr
    meta = json.loads((out / "checkpoints" / f"step-0000000{said[1]}" / "meshtron.json").read_text())
    assert meta["stopped_by"] == "SIGTERM"

    # Rank 1 starts with a stale view of the checkpoint folder (sees none): every rank resumes rank 0's choice.
    rerun = run_cli(
        [*command(cache_dir, out, "--checkpoint.async=true"), "--max-restarts", "1"],
        env=worker_env(MESHTRON_FAULT="killsave:step=6:rank=0,stale:step=0:rank=1"),
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints'}/step-0000000{said[1]}" in rerun.stdout
    newest = max(stop, 3)  # the newest complete checkpoint when step 6's save is killed (interval 3)
    assert f"restart 1 of this run after a failure: resumed from step-{newest:08d} (step {newest})" in rerun.stdout
    assert "removed step-00000006.partial" in rerun.stdout
    assert last_losses(out) == last_losses(straight)
    assert_same_tensors(out / FINAL, straight / FINAL, tmp_path)


def run_in_a_terminal_job(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python -m meshtron ARGS`` leading a process group of its own, as a shell starts a job: a ``ctrlc`` fault's
    SIGINT then reaches that group, as a terminal's Ctrl-C does, and never this test."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtron", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_75_and_a_second_one_stops_at_once(tmp_path, cache_dir):
    """A Ctrl-C (SIGINT to the launcher's whole process group, as a terminal sends it) at step 2 stops the run as
    SIGTERM does: every rank finishes its step and saves it, exit 75, one line, no traceback. The same command
    resumes, and a Ctrl-C there and a second one during the stop's save (which would then wait a minute) end it
    within seconds, without that save: exit 130, one line."""
    out = tmp_path / "run"
    stopped = run_in_a_terminal_job(command(cache_dir, out), worker_env(MESHTRON_FAULT="ctrlc:step=2:rank=1"), 300)
    assert stopped.returncode == 75, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    said = re.search(r"stopped by SIGINT after step (\d) of 8: checkpoint step-0000000(\d) saved", stopped.stdout)
    # sent on by the launcher: on a loaded machine it may reach the workers a step or two later (the second Ctrl-C
    # below comes two steps after the resumed step, at most step 7 of 8)
    assert said and said[1] == said[2] and said[1] in "2345", stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr, stopped.stderr[-3000:]
    assert [line for line in stopped.stderr.splitlines() if "fault" not in line] == [], stopped.stderr[-3000:]
    meta = json.loads((out / "checkpoints" / f"step-0000000{said[1]}" / "meshtron.json").read_text())
    assert meta["stopped_by"] == "SIGINT"

    again = run_in_a_terminal_job(
        command(cache_dir, out), worker_env(MESHTRON_FAULT=f"ctrlc2:step={int(said[1]) + 2}:rank=0"), 300
    )
    ended = time.time()
    assert again.returncode == 130, again.stdout[-2000:] + again.stderr[-3000:]
    second = float(re.search(r"sends a second Ctrl-C during the save of step \d at time ([\d.]+)", again.stderr)[1])
    assert ended - second < 15  # the save would have waited 60 s (faults.SLOW_SAVE_S)
    lines = [line for line in again.stderr.splitlines() if "fault" not in line]
    assert len(lines) == 1 and lines[0].startswith("meshtron: stopped at once by a second SIGINT"), again.stderr
    assert "stopped by SIGINT after" not in again.stdout


@pytest.mark.slow
def test_a_checkpoint_changed_in_place_is_skipped_by_every_rank_and_the_run_continues_exactly(
    straight, tmp_path, cache_dir
):
    """The uninterrupted run's folder with a byte of its step-8 tensors changed in place (sizes unchanged): the same
    command, on 2 ranks, finds it by checksum (each rank reading its share), says it skips it, resumes from step 6
    on every rank and trains steps 7 and 8 to the same losses and final weights."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(straight, out)
    shard = out / FINAL / "__1_0.distcp"
    flip_a_byte(shard)
    proc = run_cli(command(cache_dir, out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "checkpoint step-00000008 is damaged (__1_0.distcp was changed after the save" in proc.stdout, proc.stdout
    assert f"resumed from {out / 'checkpoints'}/step-00000006 (step 6" in proc.stdout, proc.stdout[-3000:]
    assert last_losses(out) == last_losses(straight)
    assert_same_tensors(out / FINAL, straight / FINAL, tmp_path)


@pytest.mark.slow
def test_a_hung_rank_stops_every_rank_within_the_timeout(tmp_path, cache_dir):
    timeout_s = 5
    proc = run_cli(
        [*command(cache_dir, tmp_path / "run"), f"--run.collective_timeout_s={timeout_s}"],
        env=worker_env(MESHTRON_FAULT="hang:step=3:rank=1"),
        timeout=120,
    )
    ended = time.time()
    assert proc.returncode == 124, proc.stdout[-2000:] + proc.stderr[-3000:]
    hung_at = float(re.search(r"rank 1 hangs at the start of step 3 at time ([\d.]+)", proc.stderr)[1])
    assert ended - hung_at < timeout_s + 15  # the watchdog's wait for reports, torchrun's shutdown
    lines = [line for line in proc.stderr.splitlines() if "made no progress" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "failed (exitcode" not in proc.stderr, proc.stderr[-3000:]  # the line says it: no report from torch
    assert re.search(
        rf"step 3 made no progress for \d+ s \(run.collective_timeout_s={timeout_s}\): rank\(s\) 1 did "
        r"not arrive \(rank 1 busy at faults.py:\d+ in before_step\); every rank exits with status 124",
        lines[0],
    ), lines[0]
