"""Context-parallel attention: sharding, document ids, and exactness against single-device attention."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_torchrun
from meshtron.distributed.context_parallel import SequenceLayout, chunk_ids, local_token_index, shard_sequence
from meshtron.models.attention import document_ids, document_positions

OP_TOLERANCE = 1e-5


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_load_balanced_shards_cover_the_sequence_once(cp):
    seq_len = 8 * cp
    shards = [local_token_index(seq_len, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.sort(torch.cat(shards)).values, torch.arange(seq_len))
    chunk = seq_len // (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = chunk_ids(cp, rank)
        assert first + second == 2 * cp - 1  # an early and a late chunk: equal causal work
        assert shard[0] == first * chunk and shard[chunk] == second * chunk
    tokens = torch.arange(seq_len).repeat(2, 1)
    assert torch.equal(shard_sequence(tokens, cp, cp - 1)[0], shards[-1])


def test_document_ids_and_positions_restart_after_each_eos():
    eos = 0
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9, 9], [0, 1, 2, 3, 4, 5, 6, 0]])
    assert document_ids(tokens, eos).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(document_ids(tokens, eos)).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_sub_blocks_hidden_by_the_masks_are_skipped():
    docs = torch.tensor([[0] * 4 + [1] * 4 + [2] * 8])  # 4 chunks of 4 at cp=2
    layout = SequenceLayout(16, cp=2, document_ids=docs)
    assert layout.block_mask(0, 1) == "skip"  # the future
    assert layout.block_mask(1, 0) == "skip"  # an earlier document only
    assert layout.block_mask(3, 2) is None  # one document spans both chunks: every key visible
    assert layout.block_mask(2, 2).shape == (1, 4, 4)
    assert SequenceLayout(16, cp=2).block_mask(2, 2) == "causal"


@pytest.mark.slow
def test_context_parallel_attention_matches_single_device(tmp_path):
    """Output and q/k/v gradients, cp 2 and 4, ring and all-gather, causal and document masks, GQA,
    with the fastest kernel and the plain-PyTorch one, against float64 whole-sequence attention."""
    out = tmp_path / "errors.json"
    proc = run_torchrun(4, ["tests/cp_attention_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert len(results) == 16
    failures = {case: errs for case, errs in results.items() if max(errs.values()) > OP_TOLERANCE}
    print("worst relative error:", max(max(e.values()) for e in results.values()))
    assert not failures, failures
