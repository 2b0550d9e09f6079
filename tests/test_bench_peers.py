"""Every peer runner of ``bench/peers.py`` trains two steps on CPU, in this process, through ``peers.main`` as
``bench/throughput.py`` starts it: an API change in torch, transformers or accelerate that breaks a peer fails
here, not on the GPU machine."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

TINY = dict(preset="llama-tiny", seq_len=32, batch=2, documents=20, mask_documents=True)
RUNNERS = ["plain-bf16", "autocast", "autocast-compile", "hf-trainer", "hf-trainer-compile"]


@pytest.fixture(scope="module")
def peers(cache_dir):
    """``bench/peers.py`` as a module, its packed data in the session's cache; no top-level name left behind."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "bench"))
        patch.setenv("XDG_CACHE_HOME", str(cache_dir))
        try:
            yield importlib.import_module("peers")
        finally:
            sys.modules.pop("peers", None)


@pytest.fixture(scope="module")
def first_loss(peers) -> float:
    """The float32 loss of the peers' model on the first global batch, with document positions."""
    setup = peers.Setup(argparse.Namespace(**TINY))
    model = setup.model(torch.device("cpu"), torch.float32)
    input_ids, labels = setup.dataset.batch(setup.schedule.global_batch(0))
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=setup.positions(input_ids), use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def test_every_peer_is_tested(peers):
    assert sorted(RUNNERS) == sorted(peers.PEERS)


@pytest.mark.parametrize("runner", RUNNERS)
def test_peer_trains_on_cpu(peers, first_loss, runner, tmp_path, monkeypatch):
    """Two steps (one timed), sequences of 32 tokens. The compiled runners compile with the ``aot_eager``
    backend instead of inductor (dynamo and AOTAutograd trace the model as on a GPU; inductor's CPU code
    generation alone takes a minute). Every runner's first loss is the float32 loss of the same model on
    the same first batch: same weights, data, order, label shift and document positions."""
    if runner in peers.PEER_NEEDS:
        pytest.importorskip(peers.PEER_NEEDS[runner], reason=f"{runner} needs {peers.PEER_NEEDS[runner]}")
    compiled = []
    real_compile = torch.compile

    def aot_eager_compile(model, **options):
        compiled.append(options.get("backend", "inductor"))
        return real_compile(model, backend="aot_eager", dynamic=options.get("dynamic"))

    monkeypatch.setattr(torch, "compile", aot_eager_compile)
    out = tmp_path / "result.json"
    argv = [
        runner,
        "--preset",
        TINY["preset"],
        "--seq-len",
        str(TINY["seq_len"]),
        "--batch",
        str(TINY["batch"]),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--documents",
        str(TINY["documents"]),
        "--device",
        "cpu",
        "--workdir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    try:
        peers.main(argv)
    finally:
        torch._dynamo.reset()
    result = json.loads(out.read_text())
    assert "error" not in result
    assert result["tokens_per_s"] > 0 and result["peak_memory_gb"] > 0
    assert math.isfinite(result["loss_last"])
    assert result["loss_first"] == pytest.approx(first_loss, abs=1e-3)  # next batch, labels shifted: >= 7e-3 off
    assert compiled == (["inductor"] if runner.endswith("-compile") else [])


def test_cuda_device_gets_an_index(peers, monkeypatch):
    """torch 2.11's ``torch.cuda.set_device`` rejects ``torch.device("cuda")``: LOCAL_RANK, else the current one."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert peers.resolve_device("cuda") == torch.device("cuda", 1)
    assert peers.resolve_device("cuda:2") == torch.device("cuda", 2)
    assert peers.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert peers.resolve_device("cuda") == torch.device("cuda", 3)
