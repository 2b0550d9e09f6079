"""Fault handling pieces that need no processes: the test-only fault spec, the restart bookkeeping and a
checkpoint's file list and checksums (the multi-process restart and damaged-checkpoint runs are in
test_checkpoint.py)."""

from __future__ import annotations

import json

import pytest
from conftest import flip_a_byte

from meshtron.checkpoint.integrity import (
    CHECKSUMS,
    content_damage,
    damage,
    file_manifest,
    manifest_checksums,
    share_of_files,
)
from meshtron.errors import ConfigError
from meshtron.resilience.faults import Fault, Faults, fault_plan, faults_from_env
from meshtron.resilience.restart import last_logged_step, restart_count, restart_message


def test_fault_spec_parses_and_bad_ones_name_the_format():
    assert faults_from_env({}) is None and fault_plan({}) == Faults()  # a normal run's plan: empty
    assert fault_plan({"MESHTRON_FAULT": "kill:step=6:rank=2"}).faults == (Fault("kill", 6, 2),)
    assert faults_from_env({"MESHTRON_FAULT": "kill:step=6:rank=2"}).faults == (Fault("kill", 6, 2),)
    several = faults_from_env({"MESHTRON_FAULT": "kill:step=3:rank=1, hang:step=5:rank=0:attempt=1,nan:step=2"})
    assert several.faults == (Fault("kill", 3, 1), Fault("hang", 5, 0, 1), Fault("nan", 2, 0))
    stale = faults_from_env({"MESHTRON_FAULT": "stale:step=3:rank=1"})
    assert stale.stale_view(1) == 3 and stale.stale_view(0) is None
    for bad in ("explode:step=1:rank=0", "kill:step=x:rank=0", "kill:rank=0", "kill:step=1:rank=0:when=now"):
        with pytest.raises(ConfigError, match="kind:step=S:rank=R"):
            faults_from_env({"MESHTRON_FAULT": bad})


def test_a_fault_fires_only_in_its_attempt_and_once(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_count() == 1
    Faults((Fault("kill", 3, 0),)).before_step(3, 0)  # would SIGKILL this test on a first start
    faults = Faults((Fault("nan", 4, 0, attempt=1), Fault("failsave", 2, 1, attempt=1)))
    assert not faults.nonfinite(3) and faults.nonfinite(4) and not faults.nonfinite(4)  # once: a rollback goes on
    faults.during_save(2, 0)  # another rank's fault
    with pytest.raises(OSError, match="No space left on device"):
        faults.during_save(2, 1)


def test_save_faults_fire_between_a_rank_writing_its_part_and_the_commit(tmp_path):
    """inject_save_faults (what the fault plan installs through RunGuard when MESHTRON_FAULT is set) wraps a
    CheckpointManager's write: a ``failsave`` fails its step's save with the manager's one-line error, after the part
    is written and before the commit, so ``latest`` still names the step before; a manager without it saves as
    usual."""
    import torch

    from meshtron.checkpoint.manager import CheckpointManager
    from meshtron.distributed.runtime import Runtime
    from meshtron.errors import MeshtronError
    from meshtron.resilience.faults import inject_save_faults

    class State:
        def state_dict(self):
            return {"w": torch.ones(2)}

    runtime = Runtime(0, 0, 1, torch.device("cpu"))
    saver = CheckpointManager(tmp_path / "ckpt", 1, 0, False, runtime)
    inject_save_faults(saver, Faults((Fault("failsave", 2, 0),)))
    saver.save(1, State(), {"step": 1}, "")
    with pytest.raises(MeshtronError, match=r"step-00000002.partial failed \(.*No space left on device \(injected\)"):
        saver.save(2, State(), {"step": 2}, "")
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000001"
    assert (tmp_path / "ckpt" / "step-00000002.partial" / ".metadata").is_file()  # its part was written
    CheckpointManager(tmp_path / "plain", 1, 0, False, runtime).save(2, State(), {"step": 2}, "")
    assert (tmp_path / "plain" / "latest").read_text() == "step-00000002"


def test_a_nan_fault_makes_only_its_steps_global_loss_nan():
    """The fault plan wraps the step's global sums (what the run's set-up gives StepContext): the loss is NaN in the
    step a ``nan`` fault marked (at the step's start), the gradient norm and flags as summed; a plan without ``nan``
    faults, as a normal run's empty one, returns the sums unchanged."""
    import math

    import torch

    def sums(loss, *args, **kwargs):
        return loss, torch.tensor(1.5), [2]

    assert Faults().wrap_step_sums(sums) is sums and Faults((Fault("kill", 3, 0),)).wrap_step_sums(sums) is sums
    faults = Faults((Fault("nan", 4, 0),))
    faulted = faults.wrap_step_sums(sums)
    faults.before_step(3, 0)
    assert faulted(torch.tensor(2.5))[0].item() == 2.5
    faults.before_step(4, 1)
    loss, grad_norm, flags = faulted(torch.tensor(2.5))
    assert math.isnan(loss.item()) and grad_norm.item() == 1.5 and flags == [2]
    faults.before_step(5, 0)
    assert faulted(torch.tensor(2.5))[0].item() == 2.5


def test_restart_bookkeeping(tmp_path):
    assert last_logged_step(tmp_path) == 0
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo'  # cut short
    )
    assert last_logged_step(tmp_path) == 3
    line = restart_message(1, tmp_path / "step-00000002", 2, 3)
    assert "restart 1 of this run" in line and "resumed from step-00000002 (step 2); 1 step(s)" in line
    assert "no checkpoint yet: starting over; 3 step(s)" in restart_message(2, None, 0, 3)


def test_a_stale_view_sees_no_checkpoint_newer_than_its_step(tmp_path):
    """A ``stale`` fault's rank chooses (with checkpoint.resume=auto) the newest whole checkpoint at or before the
    fault's step, as a rank whose cached listing predates the later saves; other ranks, and a checkpoint given by
    path, keep their start-up's choice."""
    from meshtron.checkpoint.manager import find_checkpoint, step_dir_name
    from meshtron.train.setup.run_setup import RunSetup

    for step in (3, 6):
        folder = tmp_path / step_dir_name(step)
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"x")
        (folder / "meshtron.json").write_text(json.dumps({"step": step, "files": file_manifest(folder)}))
    (tmp_path / "latest").write_text(step_dir_name(6))
    newest = find_checkpoint(tmp_path, "auto")
    assert newest == tmp_path / step_dir_name(6)
    unused = dict(dims=None, batch=None, tokenizer=None, hf_config=None, model=None, precision=None, compiled=False)
    setup = RunSetup(**unused, attention_kernel="sdpa", resume_from=newest)
    faults = faults_from_env({"MESHTRON_FAULT": "stale:step=5:rank=1,stale:step=0:rank=2"})
    assert faults.start_up_choice(setup, 1, tmp_path, "auto").resume_from == tmp_path / step_dir_name(3)
    assert faults.start_up_choice(setup, 2, tmp_path, "auto").resume_from is None
    assert faults.start_up_choice(setup, 0, tmp_path, "auto") is setup
    assert faults.start_up_choice(setup, 1, tmp_path, str(newest)) is setup
    assert Faults().start_up_choice(setup, 1, tmp_path, "auto") is setup


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


def test_checksums_find_bytes_changed_in_place_and_older_checkpoints_keep_the_size_check(tmp_path):
    """A file changed in place keeps its size (``damage`` sees nothing); its CRC-32 names it. A checkpoint saved
    before checksums existed (no crc32 in meshtron.json) is checked by size only."""
    import torch

    from meshtron.distributed.runtime import Runtime

    alone = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    (tmp_path / ".metadata").write_bytes(b"x" * 10)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    sizes = file_manifest(tmp_path)
    recorded = {"files": sizes, CHECKSUMS: manifest_checksums(tmp_path, sizes, [])}
    (tmp_path / "meshtron.json").write_text(json.dumps(recorded))
    assert damage(tmp_path) is None and content_damage(tmp_path, alone) is None
    flip_a_byte(tmp_path / "__0_0.distcp")
    assert damage(tmp_path) is None
    reason = content_damage(tmp_path, alone)
    assert reason.startswith("__0_0.distcp was changed after the save (crc32 ") and reason.endswith(" when saved)")
    (tmp_path / "meshtron.json").write_text(json.dumps({"files": sizes}))  # saved before checksums
    assert content_damage(tmp_path, alone) is None
    # a hand-edited checksum that is no whole number is a changed file on the rank that checks it, not an error there
    # alone (the other ranks would wait for it in the exchange of findings)
    edited = {**recorded, CHECKSUMS: {**recorded[CHECKSUMS], ".metadata": "1a2b"}}
    (tmp_path / "meshtron.json").write_text(json.dumps(edited))
    assert content_damage(tmp_path, alone).startswith(".metadata was changed after the save")


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_the_files_of_a_checkpoint_are_split_over_the_ranks_each_read_once(world_size):
    """Every file is checked by exactly one rank, the largest first to the least loaded, so no rank reads much more
    than its share (at most one file more)."""
    sizes = {f"__{rank}_0.distcp": 1000 + 37 * rank for rank in range(5)} | {".metadata": 3, "config.toml": 2}
    shares = [share_of_files(sizes, rank, world_size) for rank in range(world_size)]
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    loads = [sum(sizes[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert shares == [share_of_files(sizes, rank, world_size) for rank in range(world_size)]  # the same every time


def _watchdog(rank, world, store, lines, codes, **kwargs):
    import io

    from meshtron.resilience.watchdog import HangWatchdog, WatchdogIO, flight_recorder_trace, main_thread_location

    stream = io.StringIO()
    locate = kwargs.pop("locate", main_thread_location)
    dump_trace = kwargs.pop("dump_trace", flight_recorder_trace)
    io = WatchdogIO(
        poll_s=0.05, report_wait_s=0.5, locate=locate, exit=codes.append, stream=stream, dump_trace=dump_trace
    )
    watchdog = HangWatchdog(rank, world, 0.3, store, io=io, **kwargs)
    lines.append(stream)
    return watchdog


def test_hang_watchdog_names_the_ranks_that_did_not_arrive():
    """Rank 0 waits in a collective, rank 1 is busy elsewhere, rank 2 never reports: rank 0 says so in one
    line and every rank that can exits with status 124."""
    import threading

    from torch.distributed import HashStore

    from meshtron.resilience.watchdog import EXIT_HUNG

    store, streams, codes = HashStore(), [], []
    waiting = _watchdog(0, 3, store, streams, codes, locate=lambda: (True, "step_stats.py:40 in host_values"))
    busy = _watchdog(1, 3, store, streams, codes, locate=lambda: (False, "loader.py:12 in next_batch"))
    for watchdog in (waiting, busy):
        watchdog.progress(7)
    threads = [threading.Thread(target=w.give_up, args=(31.0,)) for w in (waiting, busy)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert codes == [EXIT_HUNG, EXIT_HUNG]
    said = streams[0].getvalue()
    assert said.count("\n") == 1 and streams[1].getvalue() == ""  # one rank speaks for all
    assert "step 7 made no progress for 31 s (run.collective_timeout_s=0.3): rank(s) 1, 2 did not arrive" in said
    assert "rank 1 busy at loader.py:12 in next_batch; rank 2 sent no report" in said


def test_hang_watchdog_counts_a_busy_device_stream_as_waiting_and_writes_the_flight_recorder(tmp_path):
    """Under NCCL the host runs ahead of the collectives: rank 0's host is past its all-reduce, in a sync of
    its own (`.item()`), but its device stream still has work queued; rank 1 is busy with an idle stream (a stuck
    data loader); rank 2 never reports. Rank 0 counts as waiting and names 1 and 2 only, and each rank that
    gives up writes its flight recorder where the line says, named as torch's torchfrtrace reads them."""
    import threading

    from torch.distributed import HashStore

    from meshtron.resilience.watchdog import EXIT_HUNG

    store, streams, codes = HashStore(), [], []
    synced = _watchdog(
        0,
        3,
        store,
        streams,
        codes,
        locate=lambda: (False, "experts.py:88 in exchange"),
        stream_pending=lambda: True,
        trace_dir=tmp_path,
        dump_trace=lambda: b"rank 0 trace",
    )
    busy = _watchdog(
        1,
        3,
        store,
        streams,
        codes,
        locate=lambda: (False, "loader.py:12 in next_batch"),
        stream_pending=lambda: False,
        trace_dir=tmp_path,
        dump_trace=lambda: b"rank 1 trace",
    )
    for watchdog in (synced, busy):
        watchdog.progress(7)
    threads = [threading.Thread(target=w.give_up, args=(31.0,)) for w in (synced, busy)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert codes == [EXIT_HUNG, EXIT_HUNG]
    said = streams[0].getvalue()
    folder = tmp_path / "flight-recorder-step-7"
    assert "rank(s) 1, 2 did not arrive (rank 1 busy at loader.py:12 in next_batch; rank 2 sent no report" in said
    assert f"NCCL flight recorder of each rank in {folder} (read it with: torchfrtrace {folder})" in said
    assert sorted(path.name for path in folder.iterdir()) == ["nccl_trace_rank_0", "nccl_trace_rank_1"]
    assert (folder / "nccl_trace_rank_1").read_bytes() == b"rank 1 trace"


def test_device_stream_pending_asks_the_main_threads_cuda_stream(monkeypatch):
    import torch

    from meshtron.resilience.watchdog import device_stream_pending, flight_recorder_trace

    class Stream:
        done = False

        def query(self):
            return self.done

    stream = Stream()
    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or stream)
    assert not device_stream_pending(torch.device("cpu"))() and asked == []
    pending = device_stream_pending(torch.device("cuda", 3))
    assert asked == [torch.device("cuda", 3)] and pending()
    stream.done = True
    assert not pending()
    assert flight_recorder_trace() is None  # no NCCL process group here


def test_flight_recorder_is_turned_on_unless_its_size_is_set():
    from meshtron.resilience.watchdog import enable_flight_recorder

    environ = {}
    enable_flight_recorder(environ)
    assert environ == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"}
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        environ = {name: "0"}
        enable_flight_recorder(environ)
        assert environ == {name: "0"}


def test_hang_watchdog_fires_only_without_progress():
    import time

    from torch.distributed import HashStore

    streams, codes = [], []
    watchdog = _watchdog(0, 1, HashStore(), streams, codes).start()
    for step in range(1, 11):  # progress every 0.1 s: no alarm
        watchdog.progress(step)
        time.sleep(0.1)
    assert codes == []
    deadline = time.time() + 5
    while not codes and time.time() < deadline:
        time.sleep(0.05)
    watchdog.close()
    assert codes == [124] and "step 10 made no progress" in streams[0].getvalue()


def test_a_closed_hang_watchdog_leaves_no_thread_behind():
    """close() returns once the watching thread has ended (no thread of the run outlives it at exit)."""
    from torch.distributed import HashStore

    watchdog = _watchdog(0, 1, HashStore(), [], []).start()
    watchdog.close()
    assert not watchdog._thread.is_alive()


def test_main_thread_location_tells_waiting_from_busy():
    """Seen from another thread (as the watchdog sees it): busy in this test, or waiting in a host sync."""
    import threading
    import traceback

    from meshtron.resilience.watchdog import _waits_for_ranks, main_thread_location

    seen = []

    def look():
        seen.append(main_thread_location())

    def busy():
        thread = threading.Thread(target=look)
        thread.start()
        thread.join()

    def host_values():  # the name of the step's host sync, where a rank waits for the others
        busy()

    busy()
    host_values()
    assert not seen[0][0] and seen[0][1].startswith("test_faults.py:") and seen[0][1].endswith("in busy")
    assert seen[1][0]
    # torch's elastic launcher is at the bottom of every worker that `meshtron train --nproc` forks: not a wait.
    launcher = traceback.FrameSummary("/v/torch/distributed/elastic/multiprocessing/api.py", 706, "_wrap")
    collective = traceback.FrameSummary("/v/torch/distributed/distributed_c10d.py", 2800, "all_reduce")
    assert not _waits_for_ranks(launcher) and _waits_for_ranks(collective)


def test_stop_signals_are_recorded_once_and_handlers_come_back():
    import os
    import signal

    from meshtron.resilience.preemption import StopSignals

    before, before_int = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT)
    with StopSignals() as signals:
        assert signals.flags() == [0, 0, 0] and signals.agreed(signals.flags()) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal while stopping: counted, not acted on
        assert signals.agreed(signals.flags()) == "SIGUSR1" and signals.repeated == 1
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a Ctrl-C while stopping ends the process at once
    assert signal.getsignal(signal.SIGUSR1) is before and signal.getsignal(signal.SIGINT) is before_int
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C stops as SIGTERM does, no KeyboardInterrupt
        assert signals.flags() == [0, 0, 1] and signals.agreed(signals.flags()) == "SIGINT"
    # Summed over ranks: one rank's SIGUSR1 stops all; SIGTERM wins when ranks got different ones (as a max did).
    assert StopSignals.agreed([0, 1, 0]) == "SIGUSR1" and StopSignals.agreed([1, 3, 1]) == "SIGTERM"


def test_launcher_forwards_sigusr1_and_reports_a_saved_stop(tmp_path):
    from torch.distributed.run import get_args_parser

    from meshtron.checkpoint.manager import checkpoint_directory
    from meshtron.config import load_config
    from meshtron.resilience.launcher_signals import forward_stop_signals, stopped_with_checkpoint

    launcher_args = []
    with forward_stop_signals(get_args_parser(), launcher_args, 600) as stopped:
        assert stopped.received is None
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in launcher_args
    assert "--shutdown-timeout=660" in launcher_args
    cfg = load_config(None, [f"run.output_dir={tmp_path}"], env={})
    assert (
        stopped_with_checkpoint(checkpoint_directory(cfg.checkpoint, cfg.run.output_dir), 0.0, 15) == 143
    )  # no checkpoint: as a shell reports SIGTERM
    step = tmp_path / "checkpoints" / "step-00000003"
    step.mkdir(parents=True)
    (step / "meshtron.json").write_text(json.dumps({"step": 3, "stopped_by": "SIGTERM"}))
    (tmp_path / "checkpoints" / "latest").write_text(step.name)
    assert stopped_with_checkpoint(checkpoint_directory(cfg.checkpoint, cfg.run.output_dir), 0.0, 15) == 75


def test_launcher_ends_the_workers_at_a_second_ctrl_c_and_ignores_a_second_sigterm():
    """The launcher's handler (installed by torch's agent under the name forward_stop_signals replaces): the first
    signal goes to the agent, which stops the workers with it; a repeated SIGTERM is ignored (the workers are saving);
    a SIGINT while stopping (a second Ctrl-C) ends every worker at once, also one that takes no further SIGINT (a
    rank blocked in C when both Ctrl-Cs came runs its handler once: it is still saving after its first)."""
    import logging
    import signal
    import subprocess
    import sys

    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing import api as agent_api
    from torch.distributed.run import get_args_parser

    from meshtron.resilience.launcher_signals import forward_stop_signals

    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print(1); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    worker.stdout.readline()  # it ignores SIGINT from now on

    def shown(logger, message, *args) -> bool:
        return bool(logger.filter(logging.LogRecord(logger.name, logging.WARNING, __file__, 1, message, args, None)))

    handler, start = agent_api._terminate_process_handler, local_elastic_agent.start_processes
    try:
        with forward_stop_signals(get_args_parser(), [], 600) as stopped:
            stopped.workers = type("Workers", (), {"pids": lambda self: {0: worker.pid}})()
            agent = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
            assert shown(agent, "Sending process %s closing signal %s", 7, "SIGINT")  # no signal yet
            with pytest.raises(stopped.exception):
                agent_api._terminate_process_handler(signal.SIGINT, None)
            # the agent's lines about sending it on (fresh and forked workers) are left out; a stuck worker is not
            assert not shown(agent, "Sending process %s closing signal %s", 7, "SIGINT")
            assert not shown(agent, "Closing process %s via signal %s", 7, "SIGINT")
            assert shown(agent, "Unable to shutdown process %s via %s, forcefully exiting via %s", 7, 2, 9)
            agent_api._terminate_process_handler(signal.SIGTERM, None)
            assert worker.poll() is None and not stopped.at_once
            agent_api._terminate_process_handler(signal.SIGINT, None)
            assert worker.wait(timeout=10) == -signal.SIGKILL and stopped.at_once
    finally:
        worker.kill()
    assert (agent_api._terminate_process_handler, local_elastic_agent.start_processes) == (handler, start)


def test_skipped_batches_shift_the_data_order_and_are_settings():
    from meshtron.config import load_config
    from meshtron.data.sampler import GlobalBatchSchedule

    schedule = GlobalBatchSchedule(100, 4, shuffle=True, seed=3)
    straight = [schedule.global_batch(step).tolist() for step in range(8)]
    schedule.skip([2, 3, 6])
    assert [schedule.batch_number(step) for step in range(5)] == [1, 4, 5, 7, 8]
    assert [schedule.global_batch(step).tolist() for step in range(3)] == [straight[0], straight[3], straight[4]]
    assert load_config(None, ["data.skip_batches=5,9"], env={}).data.skip_batches == [5, 9]
    assert load_config(None, ["data.skip_batches=[]"], env={}).data.skip_batches == []
    with pytest.raises(ConfigError, match="data.skip_batches: expected list of integers"):
        load_config(None, ["data.skip_batches=five"], env={})
    with pytest.raises(ConfigError, match="numbered from 1"):
        load_config(None, ["data.skip_batches=0"], env={})
    with pytest.raises(
        ConfigError, match="train.on_nonfinite=rollback reloads the last checkpoint: set checkpoint.interval"
    ):
        load_config(None, ["train.on_nonfinite=rollback"], env={})


def _train(tmp_path, cache_dir, name: str, overrides: list[str]):
    import torch

    from meshtron.config import load_config
    from meshtron.distributed.runtime import Runtime
    from meshtron.train.trainer import train

    base = [
        "model.preset=llama-deep",
        "data.max_documents=40",
        "data.seq_len=32",
        f"data.cache_dir={cache_dir}",
        "train.steps=8",
        "train.global_batch_size=8",
        "optimizer.lr=1e-3",
        "schedule.warmup_steps=2",
        "train.seed=7",
        "run.progress=false",
        "checkpoint.interval=4",
        f"run.output_dir={tmp_path / name}",
    ]
    cfg = load_config(None, base + overrides, env={})
    return train(cfg, Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))


def test_rollback_continues_as_a_run_that_skipped_the_bad_batch(tmp_path, cache_dir, monkeypatch):
    """Step 6 made NaN, train.on_nonfinite=rollback: back to the step-4 checkpoint, batch 6 left out; the
    whole trajectory and final weights equal a run given data.skip_batches=[6] (exact, fp32 CPU)."""
    import torch

    skipped = _train(tmp_path, cache_dir, "skipped", ["data.skip_batches=6"])
    monkeypatch.setenv("MESHTRON_FAULT", "nan:step=6")
    rolled = _train(tmp_path, cache_dir, "rolled", ["train.on_nonfinite=rollback"])
    assert len(rolled.losses) == 8 and rolled.losses == skipped.losses
    want, got = skipped.model.state_dict(), rolled.model.state_dict()
    assert all(torch.equal(got[key], want[key]) for key in want)
    rows = [json.loads(line) for line in (tmp_path / "rolled" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert rows[5]["rolled_back_to"] == 4 and rows[5]["loss"] != rows[5]["loss"]  # NaN
    assert [row.get("rollbacks", 0) for row in rows[6:]] == [1] * 4
    meta = json.loads((tmp_path / "rolled" / "checkpoints" / "step-00000008" / "meshtron.json").read_text())
    assert meta["data.skip_batches"] == [6]


def test_rollbacks_in_a_row_or_before_any_checkpoint_stop_the_run(tmp_path, cache_dir, monkeypatch):
    from meshtron.errors import MeshtronError

    monkeypatch.setenv("MESHTRON_FAULT", "nan:step=5,nan:step=6")  # no checkpoint between the two
    with pytest.raises(
        MeshtronError, match=r"step 6: loss is nan .* after 1 rollback\(s\) in a row \(train.max_rollbacks=1\)"
    ):
        _train(tmp_path, cache_dir, "twice", ["train.on_nonfinite=rollback", "train.max_rollbacks=1"])
    monkeypatch.setenv("MESHTRON_FAULT", "nan:step=2")
    with pytest.raises(MeshtronError, match="has no checkpoint to go back to yet"):
        _train(tmp_path, cache_dir, "early", ["train.on_nonfinite=rollback"])
