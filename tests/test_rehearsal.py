"""The rehearsal's process group (meshtron.distributed.one_rank_group) against torch 2.11's fake backend.

torch 2.11's ``fake`` backend writes only all-gathers: a reduce-scatter's, all-to-all's or receive's output stays as
``torch.empty`` left it, recycled (often NaN) memory on CUDA. On CPU fresh pages are zeros, so these tests make it
visible: ``torch_211_fake`` puts 2.11's behaviour back on this torch (kernels that write nothing) and turns on torch's
deterministic mode, whose ``torch.empty`` fills floats with NaN and integers with their largest value.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import warnings

import pytest
import torch
import torch.distributed as dist

UNWRITTEN_BY_TORCH_2_11 = [
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_base_",
    "alltoall_",
    "recv_",
    "recv_any_source_",
    "scatter_",
]


@contextlib.contextmanager
def torch_211_fake():
    """CPU collectives that leave their outputs unwritten (torch 2.11's fake backend) over NaN-filled empties."""
    from torch._C._distributed_c10d import FakeWork

    def unwritten(returns_outputs: bool):
        def kernel(*args):
            work = FakeWork().boxed()
            return (args[0], work) if returns_outputs else work

        return kernel

    library = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in UNWRITTEN_BY_TORCH_2_11:
            schema = getattr(torch.ops.c10d, name).default._schema
            library.impl(name, unwritten(len(schema.returns) == 2), "CPU")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        library._destroy()


def _collectives(rank: int, world: int) -> dict:
    """Outputs of the collectives a rehearsal meets, on a fake world, as lists."""
    from torch.distributed._functional_collectives import all_to_all_single, reduce_scatter_tensor

    x = torch.arange(2.0 * world) + 10 * rank
    out = {}
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, x)
    out["reduce_scatter"] = scattered.tolist()
    out["functional_reduce_scatter"] = reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD).tolist()
    counts = torch.arange(world) + 1
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    out["all_to_all_counts"] = received.tolist()
    rows = torch.arange(3.0)
    out["functional_all_to_all"] = all_to_all_single(
        rows, [3] + [0] * (world - 1), [3] + [0] * (world - 1), dist.group.WORLD
    ).tolist()
    buffer = torch.empty(3)
    dist.irecv(buffer, (rank + 1) % world).wait()
    out["recv"] = buffer.tolist()
    gathered = torch.empty(2 * world)
    dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0]))
    out["all_gather"] = gathered.tolist()
    return out


def test_one_rank_group_collectives_give_what_one_rank_has():
    """Reduce-scatter: this rank's chunk; all-to-all: its own input (counts too); receive: zeros; all-gather: its
    input in every slot; through torch.distributed and the functional collectives DTensor uses. Under torch 2.11's
    fake semantics alone (no one-rank kernels) the same calls leave NaN, what the rehearsal used to train on."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshtron.distributed.one_rank_group import one_rank_group

    with torch_211_fake():
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        try:
            unfixed = _collectives(1, 4)
        finally:
            dist.destroy_process_group()
        with one_rank_group(1, 4):
            fixed = _collectives(1, 4)
    assert math.isnan(unfixed["reduce_scatter"][0]) and math.isnan(unfixed["recv"][0])
    assert math.isnan(unfixed["functional_reduce_scatter"][0])
    assert unfixed["all_to_all_counts"] != [1, 2, 3, 4]  # the largest int64: garbage split sizes
    assert fixed == {
        "reduce_scatter": [12.0, 13.0],
        "functional_reduce_scatter": [12.0, 13.0],
        "all_to_all_counts": [1, 2, 3, 4],
        "functional_all_to_all": [0.0, 1.0, 2.0],
        "recv": [0.0, 0.0, 0.0],
        "all_gather": [1.0, 2.0] * 4,
    }
    # and they are gone with the group: a later fake world is torch's own again
    with torch_211_fake():
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        try:
            assert math.isnan(_collectives(1, 4)["reduce_scatter"][0])
        finally:
            dist.destroy_process_group()


def _rehearse_under_torch_211(overrides: list[str], world: int, rank: int) -> dict:
    """Rehearse rank ``rank`` with ``train.on_nonfinite=skip`` under torch 2.11's fake semantics; its losses."""
    import meshtron.train.trainer as trainer
    from meshtron.config import load_config
    from meshtron.plan.rehearsal import rehearse

    losses = []
    train = trainer.train

    def recorded(*args, **kwargs):  # the rehearsal reports no losses (meaningless); this rank's, as trained
        result = train(*args, **kwargs)
        losses.extend(result.losses)
        return result

    trainer.train = recorded  # in this forked child only
    cfg = load_config(None, overrides + ["--train.on_nonfinite=skip"], env={})
    with torch_211_fake():
        report = rehearse(cfg, world, rank, steps=2)
    return {"losses": losses, "notes": report.notes, "state_bytes": report.measured["state_bytes"]}


REHEARSED_UNDER_2_11 = {
    # FSDP's and sequence-parallel TP's reduce-scatters, EP's count and row all-to-alls (before: negative split sizes)
    "fsdp-tp-ep": (
        4,
        0,
        ["--model.preset=qwen3moe-tiny", "--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.ep=2"],
    ),
    # the last pipeline stage: its receives, FSDP's reduce-scatter, and its sequence-parallel output, whose shape
    # (the whole sequence: a DTensor) torch 2.11 checks against the rehearsal's static shapes (a shard's, before)
    "pp-fsdp-tp": (
        8,
        6,
        ["--model.preset=llama-tiny", "--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.tp=2"],
    ),
}


@pytest.mark.parametrize("name", list(REHEARSED_UNDER_2_11))
def test_rehearsal_is_finite_when_fake_collectives_leave_nan(name, tmp_path, cache_dir):
    """A rehearsal whose fake collectives would hand back NaN-filled (or garbage-count) buffers trains with finite
    losses and skips no step (``on_nonfinite=skip`` would hide it: the rehearsal no longer forces it)."""
    world, rank, layout = REHEARSED_UNDER_2_11[name]
    overrides = layout + [
        "--data.seq_len=32",
        "--data.max_documents=40",
        f"--data.cache_dir={cache_dir}",
        "--train.global_batch_size=4",
        f"--run.output_dir={tmp_path / 'out'}",
        "--run.device=cpu",
    ]
    # a fork: DTensor's caches keyed by mesh must not hand this rehearsal's groups to a later one in this process
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply(_rehearse_under_torch_211, (overrides, world, rank))
    assert got["losses"] and all(math.isfinite(loss) for loss in got["losses"]), got
    assert not any("non-finite" in note for note in got["notes"]), got["notes"]
    assert got["state_bytes"] > 0  # an update was measured


def test_rehearse_layouts_tiny_on_cpu(tmp_path, cache_dir, capsys, monkeypatch):
    """``bench/rehearse_layouts.py --tiny``: a TP rank, three pipeline stages, the first and last stage of a DPO run
    with a frozen-copy reference and an EP rank under balanced and worst-case routing, each rehearsed in a fork,
    printed as rows and written as JSON; the state each holds (and the DPO ranks' reference) is what the planner says,
    the pipeline's skew is reported, and worst-case routing keeps more activations than balanced."""
    import importlib

    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    bench = importlib.import_module("rehearse_layouts")
    out = tmp_path / "rows.json"
    result = bench.main(
        ["--tiny", "--only", "tp8,pp8-1F1B,dpo-pp2xfsdp4,ep8-qwen3moe", f"--cache-dir={cache_dir}", f"--json={out}"]
        + [f"--output-dir={tmp_path / 'runs'}"]
    )
    printed = capsys.readouterr().out
    rows = result["rows"]
    assert json.loads(out.read_text())["rows"] == rows
    assert [(row["layout"], row["rank"], row["routing"]) for row in rows] == [
        ("tp8", 1, "balanced"),
        ("pp8-1F1B", 0, "balanced"),
        ("pp8-1F1B", 2, "balanced"),
        ("pp8-1F1B", 3, "balanced"),
        ("dpo-pp2xfsdp4", 0, "balanced"),
        ("dpo-pp2xfsdp4", 3, "balanced"),
        ("ep8-qwen3moe", 0, "balanced"),
        ("ep8-qwen3moe", 0, "worst"),
    ]
    assert all("error" not in row for row in rows), [row.get("error") for row in rows]
    assert sum(line.startswith(("tp8 ", "pp8-1F1B ", "dpo-", "ep8-qwen3moe ")) for line in printed.splitlines()) == 8
    for row in rows:
        assert abs(row["diffs"]["state_bytes"]) <= bench.MEMORY_TOLERANCE, row
        assert row["measured"]["step_s"] > 0
    # DPO with a frozen-copy reference: the first and the last stage (whose reference forward receives nothing on the
    # fake process group) hold the reference's planned bytes exactly
    for row in rows[4:6]:
        assert row["measured"]["reference_bytes"] == row["planned"]["reference_bytes"] > 0, row
    assert set(result["pipeline_skew"]) == {"pp8-1F1B", "dpo-pp2xfsdp4"}
    skew = result["pipeline_skew"]["pp8-1F1B"]
    assert 0 < skew["measured"] < 1 and 0 < skew["planned"] < 1
    balanced, worst = rows[-2]["measured"], rows[-1]["measured"]
    assert worst["activation_bytes"] > balanced["activation_bytes"]  # every rank's tokens on this rank's experts
    assert worst["state_bytes"] == balanced["state_bytes"]
