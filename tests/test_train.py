"""The training loop in one process, its schedule, clipping, non-finite detection, and the CLI launcher."""

from __future__ import annotations

import json
import math
import re
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import run_cli, worker_env

from meshtron.cli import main
from meshtron.config import load_config, save_config
from meshtron.data.tokenizer import load_tokenizer
from meshtron.data.training_data import build_training_data
from meshtron.distributed.grad_norm import clip_gradients, global_grad_norm
from meshtron.distributed.runtime import Runtime
from meshtron.errors import ConfigError, MeshtronError
from meshtron.train.optim.build import lr_at
from meshtron.train.trainer import train

CPU_RUNTIME = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def small_config(tmp_path, cache_dir, *extra: str):
    return load_config(
        None,
        [
            "model.preset=tiny",
            "data.max_documents=30",
            "data.seq_len=32",
            f"data.cache_dir={cache_dir}",
            "train.steps=8",
            "train.global_batch_size=4",
            "optimizer.lr=3e-3",
            "schedule.warmup_steps=2",
            "run.progress=false",
            f"run.output_dir={tmp_path / 'run'}",
            *extra,
        ],
        env={},
    )


def test_single_process_run_writes_metrics_and_config(tmp_path, cache_dir):
    cfg = small_config(tmp_path, cache_dir)
    result = train(cfg, CPU_RUNTIME)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "max_memory_gb", "elapsed_s"} <= set(record)
        assert record["mfu"] is None and record["tokens_per_s"] > 0 and record["max_memory_gb"] > 0
    assert [r["loss"] for r in records] == pytest.approx(result.losses)
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, cfg) for s in range(8)])
    assert records[-1]["loss"] < records[0]["loss"]
    saved = load_config(tmp_path / "run" / "config.toml", env={})
    assert saved == cfg


def test_same_config_same_losses(tmp_path, cache_dir):
    first = train(small_config(tmp_path / "a", cache_dir), CPU_RUNTIME).losses
    second = train(small_config(tmp_path / "b", cache_dir), CPU_RUNTIME).losses
    third = train(small_config(tmp_path / "c", cache_dir, "train.seed=1"), CPU_RUNTIME).losses
    unprefetched = train(small_config(tmp_path / "d", cache_dir, "data.prefetch=false"), CPU_RUNTIME).losses
    assert first == second == unprefetched  # data.prefetch only changes when batches are read
    assert first != third


def schedule(name: str, *extra: str):
    overrides = ["train.steps=110", "schedule.warmup_steps=10", "optimizer.lr=1.0", "schedule.min_lr=0.1"]
    return load_config(None, [*overrides, f"schedule.kind={name}", *extra], env={})


def test_lr_schedule_shape():
    cfg = schedule("cosine")
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(109, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 109))


def test_linear_constant_and_wsd_schedules():
    linear, constant = schedule("linear"), schedule("constant")
    assert lr_at(0, linear) == pytest.approx(0.1) and lr_at(9, linear) == pytest.approx(1.0)
    assert lr_at(60, linear) == pytest.approx(0.55) and lr_at(109, linear) == pytest.approx(0.109)
    assert lr_at(0, constant) == pytest.approx(0.1) and all(lr_at(s, constant) == 1.0 for s in range(9, 110))
    # WSD: 22 of the 110 steps decay (decay_fraction 0.2), from step 88 (0-based) on; lr before that.
    for shape, halfway in (("linear", 0.55), ("cosine", 0.55), ("1-sqrt", 0.1 + 0.9 * (1 - 0.5**0.5))):
        wsd = schedule("wsd", f"schedule.decay_shape={shape}")
        assert lr_at(5, wsd) == pytest.approx(0.6)
        assert all(lr_at(s, wsd) == 1.0 for s in range(9, 89))
        assert lr_at(99, wsd) == pytest.approx(halfway), shape
        assert lr_at(109, wsd) < 0.2 and all(lr_at(s, wsd) >= lr_at(s + 1, wsd) for s in range(88, 109))
    late = schedule(
        "wsd", "schedule.decay_fraction=1.0", "schedule.decay_shape=linear"
    )  # all of it: decay after warmup
    assert [lr_at(s, late) for s in (9, 10, 60)] == pytest.approx([1.0, 1.0, 0.55])


def test_a_wsd_run_resumed_with_more_steps_continues_its_stable_phase(tmp_path, cache_dir, capsys):
    """8 steps of WSD (decay from step 7) saved at step 4 and resumed with train.steps=16: the same losses and
    learning rates as 16 steps from the start (decay from step 13), without a warning (the rate does not change).
    A run resumed under another schedule trains with that schedule's rate from its first step (not the one the
    checkpoint's run would have used), and warns of the jump."""
    wsd = ["schedule.kind=wsd", "schedule.decay_fraction=0.25", "checkpoint.interval=4", "schedule.min_lr=3e-4"]
    short = small_config(tmp_path / "short", cache_dir, *wsd)
    train(short, CPU_RUNTIME)
    saved = f"checkpoint.resume={tmp_path / 'short' / 'run' / 'checkpoints' / 'step-00000004'}"
    longer = small_config(tmp_path / "longer", cache_dir, *wsd, "train.steps=16", saved)
    capsys.readouterr()
    resumed = train(longer, CPU_RUNTIME)
    assert "warning" not in capsys.readouterr().out
    straight = train(small_config(tmp_path / "straight", cache_dir, *wsd, "train.steps=16"), CPU_RUNTIME)
    assert resumed.losses == straight.losses[4:]

    def rates(folder: Path) -> list[float]:
        return [json.loads(line)["lr"] for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]

    assert rates(tmp_path / "longer") == rates(tmp_path / "straight")[4:]
    assert rates(tmp_path / "straight")[4:12] == [3e-3] * 8 and rates(tmp_path / "straight")[-1] < 1e-3
    cosine = small_config(tmp_path / "cosine", cache_dir, *wsd, "train.steps=16", saved, "schedule.kind=cosine")
    train(cosine, CPU_RUNTIME)
    assert rates(tmp_path / "cosine")[0] == pytest.approx(lr_at(4, cosine)) and lr_at(4, cosine) < 3e-3
    assert (
        "meshtron: warning: train.steps 8 -> 16, schedule.kind wsd -> cosine change the schedule: lr at step 5 "
        f"drops 3.00e-03 -> {lr_at(4, cosine):.2e}; " in capsys.readouterr().out
    )


def trained_sequences(monkeypatch) -> list[list[int]]:
    """Records the global batch (sequence indices) of every step a run trains, as the step reads it."""
    from meshtron.data.prefetch import StepReader

    seen: list[list[int]] = []
    original = StepReader.get

    def get(self, step):
        seen.append([int(i) for i in self.sequences(step).global_batch])
        return original(self, step)

    monkeypatch.setattr(StepReader, "get", get)
    return seen


def test_a_run_resumed_with_another_global_batch_trains_every_sequence_once(tmp_path, cache_dir, monkeypatch):
    """4 steps of 8 sequences saved at step 2, resumed with train.global_batch_size=4 (and a batch size rampup from
    2): the sequences the two starts trained are the first ones of the data order, each once, none skipped; a
    rampup of 2:3 trains batches of 2, 4, 6, then 8 sequences."""
    seen = trained_sequences(monkeypatch)
    first = small_config(
        tmp_path / "a", cache_dir, "train.steps=4", "train.global_batch_size=8", "checkpoint.interval=2"
    )
    train(first, CPU_RUNTIME)
    before, seen[:] = seen[:2], []  # steps 1-2 of the first start are what the checkpoint holds
    saved = f"checkpoint.resume={tmp_path / 'a' / 'run' / 'checkpoints' / 'step-00000002'}"
    resumed = small_config(tmp_path / "b", cache_dir, "train.steps=6", "train.global_batch_size=4", saved)
    result = train(resumed, CPU_RUNTIME)
    assert result.start_step == 2 and [len(batch) for batch in seen] == [4, 4, 4, 4]
    trained = [i for batch in before + seen for i in batch]
    assert len(trained) == len(set(trained)) == 2 * 8 + 4 * 4
    order = build_training_data(resumed.data, load_tokenizer("byte"), 4, is_builder=True).schedule  # positions 0..
    assert sorted(trained) == sorted(int(i) for i in order.indices(0, len(trained)))
    seen[:] = []
    ramp = small_config(
        tmp_path / "ramp", cache_dir, "train.steps=5", "train.global_batch_size=8", "train.batch_rampup=2:3"
    )
    train(ramp, CPU_RUNTIME)
    assert [len(batch) for batch in seen] == [2, 4, 6, 8, 8]
    ramped = [i for batch in seen for i in batch]
    assert ramped == [int(i) for i in order.indices(0, 28)]


def test_a_run_resumed_with_another_seq_len_trains_on_from_the_rest_of_its_epoch(tmp_path, cache_dir, monkeypatch):
    """2 steps at data.seq_len=32 saved, resumed with data.seq_len=48: the resumed steps read the carry (the epoch's
    untrained tokens cut into sequences of 48 + 1, meshtron.data.carry), no stream token twice; a checkpoint saved
    inside the carry records the change, and a run resumed from it reads and trains as the run that saved it."""
    import meshtron.train.trainer as trainer_module
    from meshtron.data.carry import SEQ_LEN_CHANGES

    seen, datasets = trained_sequences(monkeypatch), []

    def keep_dataset(*args, **kwargs):
        data = build_training_data(*args, **kwargs)
        datasets.append(data.dataset)
        return data

    monkeypatch.setattr(trainer_module, "build_training_data", keep_dataset)
    train(small_config(tmp_path / "a", cache_dir, "train.steps=4", "checkpoint.interval=2"), CPU_RUNTIME)
    short, before, seen[:] = datasets[-1], seen[:2], []
    saved = f"checkpoint.resume={tmp_path / 'a' / 'run' / 'checkpoints' / 'step-00000002'}"
    longer = small_config(tmp_path / "b", cache_dir, "data.seq_len=48", "checkpoint.interval=2", "train.steps=6", saved)
    resumed = train(longer, CPU_RUNTIME)
    carried, after = datasets[-1], seen[:]
    assert carried.carry is not None and carried.carry.start == 2 * 4 and carried.seq_len == 48
    assert [i for batch in after for i in batch] == [len(carried) + j for j in carried.carry.order[:16]]

    def positions(dataset, batches) -> list[int]:
        return [p for batch in batches for i in batch for a, b in dataset.sequence_ranges(i) for p in range(a, b)]

    trained = positions(short, before) + positions(carried, after)
    assert len(trained) == len(set(trained)) == 2 * 4 * 33 + 4 * 4 * 49
    meta = json.loads((tmp_path / "b" / "run" / "checkpoints" / "step-00000004" / "meshtron.json").read_text())
    assert meta[SEQ_LEN_CHANGES] == [[8, 32, 48]]
    seen[:] = []
    inside = f"checkpoint.resume={tmp_path / 'b' / 'run' / 'checkpoints' / 'step-00000004'}"
    again = train(small_config(tmp_path / "c", cache_dir, "data.seq_len=48", "train.steps=6", inside), CPU_RUNTIME)
    assert seen == after[2:] and again.losses == resumed.losses[2:]


def test_clipping_uses_the_global_norm():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    norm = global_grad_norm(params)
    assert norm.item() == pytest.approx(5.0)
    clip_gradients(params, 1.0, norm)
    assert global_grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)
    clip_gradients(params, 10.0, global_grad_norm(params))
    assert global_grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)


# An lr of 1e30 from the first step, unclipped: the run diverges.
DIVERGING = ("optimizer.lr=1e30", "schedule.min_lr=1e29", "schedule.warmup_steps=0", "optimizer.max_grad_norm=0")


def test_nonfinite_loss_stops_with_a_clear_error(tmp_path, cache_dir):
    cfg = small_config(
        tmp_path,
        cache_dir,
        *DIVERGING,
    )
    with pytest.raises(MeshtronError, match="training diverged.*train.on_nonfinite=skip"):
        train(cfg, CPU_RUNTIME)


def test_nonfinite_skip_leaves_weights_untouched(tmp_path, cache_dir):
    cfg = small_config(
        tmp_path,
        cache_dir,
        *DIVERGING,
        "train.on_nonfinite=skip",
    )
    result = train(cfg, CPU_RUNTIME)
    bad = [
        i
        for i, (loss, norm) in enumerate(zip(result.losses, result.grad_norms))
        if not (math.isfinite(loss) and math.isfinite(norm))
    ]
    assert bad, "the run was expected to diverge"
    assert len(result.losses) == 8
    # Had a non-finite step reached the optimizer, Adam would have written NaN into the weights.
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_collective_timeout_setting_reaches_the_process_group(capsys, monkeypatch, tmp_path, cache_dir):
    """Collectives time out COLLECTIVE_GRACE_S after the hang watchdog, which names the ranks that did not arrive."""
    import torch.distributed as dist

    from meshtron.resilience.watchdog import COLLECTIVE_GRACE_S

    seen = []

    def init_process_group(*args, timeout=None, **kwargs):
        seen.append(timeout)
        raise MeshtronError("stopped at the process group")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)
    code = main(
        [
            "train",
            "--model.preset=tiny",
            "--data.max_documents=30",
            "--data.seq_len=32",
            f"--data.cache_dir={cache_dir}",
            f"--run.output_dir={tmp_path / 'run'}",
            "--run.collective_timeout_s=7200",
        ]
    )
    assert "stopped at the process group" in capsys.readouterr().err
    assert code == 1 and seen == [timedelta(seconds=7200 + COLLECTIVE_GRACE_S)]


@pytest.mark.slow
def test_cli_self_launch_trains_on_two_processes(tmp_path, cache_dir):
    """Without run.output_dir the launcher fixes one (runs/<timestamp>) for its workers: they checkpoint there. It
    first names an earlier run of the same settings with a checkpoint (docs/checkpointing.md), as the launcher."""
    settings = [
        "--model.preset=tiny",
        "--data.max_documents=30",
        "--data.seq_len=32",
        "--train.steps=6",
        "--train.global_batch_size=4",
        "--optimizer.lr=3e-3",
    ]
    earlier = tmp_path / "runs" / "earlier"
    (earlier / "checkpoints").mkdir(parents=True)
    save_config(load_config(None, [*settings, f"--run.output_dir={earlier}"], env={}), earlier / "config.toml")
    (earlier / "checkpoints" / "latest").write_text("step-00000003")
    proc = run_cli(
        [
            "train",
            "--nproc",
            "2",
            *settings,
            f"--data.cache_dir={cache_dir}",
            "--run.log_every=2",
            "--checkpoint.interval=3",
            "--run.profile_steps=2-3",  # docs/profiling.md: a trace per rank, FSDP's collectives in the summary
        ],
        timeout=240,
        cwd=tmp_path,
        env={key: value for key, value in worker_env().items() if key != "OMP_NUM_THREADS"},  # as a user starts it
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # No torchrun banner (the launcher sets OMP_NUM_THREADS), no torchao deprecation lines (transformers imports it).
    assert "OMP_NUM_THREADS" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr[-3000:]
    # The done line's command runs as printed, where PATH does not hold meshtron's venv (not activated).
    [command] = re.findall(r"^  see the curves:\s+(.+)$", proc.stdout, re.MULTILINE)
    shown = subprocess.run(
        ["/bin/sh", "-c", command], cwd=tmp_path, env={**worker_env(), "PATH": "/usr/bin:/bin"}, capture_output=True
    )
    assert shown.returncode == 0, (command, shown.stderr[-2000:])
    [out] = [folder for folder in (tmp_path / "runs").iterdir() if folder != earlier]
    assert (out / "metrics.png").is_file()
    assert "layout: dp_shard=2" in proc.stdout
    assert "holds an earlier run of the same settings with a checkpoint of step 3 of 6; " in proc.stdout
    assert "run the same command with --run.output_dir=runs/earlier" in proc.stdout
    assert "step 6/6" in proc.stdout and f"outputs in {out.relative_to(tmp_path)}" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 6]  # run.log_every=2, and always the first step
    assert (out / "checkpoints" / "latest").read_text() == "step-00000006"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-00000003", "step-00000006"]
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["rank-0.json", "rank-1.json"]
    assert all(json.loads(p.read_text())["traceEvents"] for p in (out / "profile").iterdir())
    communication = re.search(r"^  communication\s+([\d.]+) ms", proc.stdout, re.MULTILINE)
    assert communication and float(communication.group(1)) > 0, proc.stdout


def test_step_sums_carry_the_flags_of_every_rank_in_the_one_all_reduce(monkeypatch):
    """The step's all-reduce (here of 2 ranks: another rank's numbers added) sums the flags with the loss and norm."""
    import torch.distributed as dist

    from meshtron.train.step_stats import global_step_sums

    calls = []

    def all_reduce(tensor):  # rank 1: loss share 1.0, its half of the replicated gradient's square, flags (0, 1, 1)
        calls.append(tensor.clone())
        tensor.add_(torch.tensor([1.0, 12.5, 0.0, 1.0, 1.0]))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])
    loss, norm, flags = global_step_sums(torch.tensor(3.0), [param], 4, flags=[1, 0, 1])
    assert len(calls) == 1 and float(loss) == 1.0 and float(norm) == 5.0 and flags.tolist() == [1.0, 1.0, 2.0]


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group: every path that agrees across ranks runs, with nothing to wait for."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_stop_signals_and_async_saves_add_no_collective_to_a_step(tmp_path, cache_dir, monkeypatch, one_rank_group):
    """The flags of a stop signal and of an async save in flight ride in the step's own all-reduce (issue 43,
    finding 10): in a one-rank group (whose step needs no all-reduce) a run with async saves makes none at all,
    and SIGUSR1 at step 3 still stops it after step 3 with that step's checkpoint saved."""
    import os
    import signal

    import torch.distributed as dist

    import meshtron.train.trainer as trainer
    from meshtron.resilience.preemption import Preempted

    calls = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs))
    train_step = trainer.train_step

    def signalled_step(model, optimizer, inputs, step, *args, **kwargs):
        if step == 2:  # 0-based: step 3 as the logs count
            os.kill(os.getpid(), signal.SIGUSR1)
        return train_step(model, optimizer, inputs, step, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", signalled_step)
    cfg = small_config(tmp_path, cache_dir, "train.steps=6", "checkpoint.interval=2", "checkpoint.async=true")
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert runtime.distributed
    with pytest.raises(Preempted, match="stopped by SIGUSR1 after step 3 of 6: checkpoint step-00000003 saved"):
        train(cfg, runtime)
    assert calls == []
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-00000003"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]


def test_workers_resolve_the_resume_point_on_rank_0_and_every_rank_takes_its_choice_or_its_error(
    tmp_path, cache_dir, monkeypatch, one_rank_group
):
    """Issue 43, finding 5. Under torchrun only rank 0 resolves checkpoint.resume (the other ranks may see the
    directory differently); a problem it finds is raised on every rank once the process group exists, and a
    launcher or a single process still raises it in preflight. (Ranks with different views: test_recovery.py.)"""
    import torch.distributed as dist

    from meshtron.train.setup.preflight import agree_resume_point, preflight

    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-00000003").mkdir(parents=True)  # no meshtron.json: not a whole checkpoint
    cfg = small_config(tmp_path, cache_dir, f"checkpoint.dir={checkpoints}")
    with pytest.raises(MeshtronError, match="no whole checkpoint to resume from"):
        preflight(cfg, 2, "cpu")  # the launcher's check, before any worker starts
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    other = preflight(cfg, 2, "cpu")  # looks at no checkpoint
    assert not other.resume_agreed and other.resume_error is None and other.resume_from is None
    monkeypatch.setenv("RANK", "0")
    main_plan = preflight(cfg, 2, "cpu")
    assert "no whole checkpoint to resume from" in str(main_plan.resume_error)
    runtime = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(MeshtronError, match="no whole checkpoint to resume from"):
        agree_resume_point(main_plan, runtime)

    sent = []

    def from_rank_0(message):  # what rank 1 receives from rank 0's broadcast
        def broadcast_object_list(objects, src):
            assert src == 0 and objects == [None]
            sent.append(1)
            objects[0] = message

        return broadcast_object_list

    rank_1 = Runtime(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))
    chosen = str(checkpoints / "step-00000006")
    monkeypatch.setattr(dist, "broadcast_object_list", from_rank_0((chosen, ["step-00000007 is damaged"], None)))
    agreed = agree_resume_point(other, rank_1)
    assert agreed.resume_agreed and agreed.resume_from == Path(chosen)
    assert agreed.resume_skipped == ("step-00000007 is damaged",) and sent == [1]
    assert agree_resume_point(agreed, rank_1) is agreed and sent == [1]  # once
    monkeypatch.setattr(dist, "broadcast_object_list", from_rank_0((None, [], (True, "checkpoint.resume: bad"))))
    with pytest.raises(ConfigError, match="checkpoint.resume: bad"):
        agree_resume_point(other, rank_1)
