"""Context-parallel attention: sharding, document ids, the tile plan and kernels, and exactness
against single-device attention."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import warnings

import pytest
import torch
from conftest import REPO, full_blocks, run_forked
from torch.nn.attention.flex_attention import create_mask

from meshtron.distributed.context_parallel import (
    SequenceLayout,
    context_parallel_attention,
    local_token_index,
    shard_sequence,
    tile_kernels,
)
from meshtron.distributed.context_parallel import fused_tile_kernels as fused
from meshtron.distributed.context_parallel import tiles as plans
from meshtron.distributed.context_parallel.layout import chunk_ids
from meshtron.models.attention import document_ids, document_positions
from meshtron.train.batch import SequenceSplit, sequence_inputs

OP_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    # Eager flex_attention warns that it is the unfused reference; that is what the CPU tests want.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


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
    assert document_positions(document_ids(tokens, eos)).tolist() == [
        [0, 1, 0, 1, 2, 0, 0, 1],
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]


def test_tiles_are_classified_from_the_chunks_document_ranges():
    docs = torch.tensor([[0] * 4 + [1] * 2 + [2] * 10])  # 4 chunks of 4 at cp=2
    layout = SequenceLayout(16, cp=2, rank=0, document_ids=docs)
    ends = docs.reshape(1, 4, 4)
    first, last = ends[:, :, 0].tolist(), ends[:, :, -1].tolist()
    kinds = {(q, kv): plans.classify(first, last, q, kv) for q, kv in itertools.product(range(4), repeat=2)}
    assert kinds[0, 1] == "skip"  # the future
    assert kinds[1, 0] == "skip"  # an earlier document only
    assert kinds[3, 2] == "full"  # one document spans both chunks: every key visible
    assert kinds[2, 1] == "masked" and kinds[1, 1] == "masked"  # a document border inside
    assert kinds[0, 0] == kinds[2, 2] == "causal"  # the diagonal within one document
    assert {plans.classify(None, None, q, kv) for q, kv in [(1, 0), (3, 0)]} == {"full"}
    assert (plans.classify(None, None, 2, 2), plans.classify(None, None, 1, 2)) == ("causal", "skip")

    plan = plans.plan_tiles(layout, "cpu")  # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert plan[0] == [(0, 0, "causal"), (1, 1, "causal")]  # (0, 3) future, (3, 0) earlier document
    assert [(qi, ki) for qi, ki, _ in plan[1]] == [(1, 0), (1, 1)]  # (3, 1) masked, (3, 2) full
    assert plan[1][0][2].shape == (1, 4, 4) and plan[1][1][2] is None


def test_sequence_inputs_plan_the_tiles_once_per_micro_batch(monkeypatch):
    calls = []
    plan = plans.plan_tiles
    monkeypatch.setattr(plans, "plan_tiles", lambda *args: calls.append(args) or plan(*args))
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9, 9, 4, 4, 0, 3, 3, 3, 3, 0]])
    split = SequenceSplit(cp=2, cp_rank=1, mask_documents=True, eos_token_id=0)
    layout = sequence_inputs(tokens, split)["sequence_layout"]
    assert len(calls) == 1 and list(layout.attention_cache) == [("cp", "cpu", "dense")]
    for _ in range(3):  # every layer, forward and backward
        assert plans.planned_tiles(layout, torch.device("cpu")) is layout.attention_cache["cp", "cpu", "dense"]
    assert len(calls) == 1


def host_reads_in_tiles(monkeypatch) -> list[str]:
    """Record every ``.tolist()`` / ``.item()`` made while the tile planner (context_parallel/tiles.py) is on the
    stack: on a device each is a host sync."""
    reads = []
    for method in ("tolist", "item"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.endswith(("context_parallel/tiles.py", "context_parallel\\tiles.py")):
                    reads.append(_method)
                    break
                frame = frame.f_back
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return reads


def test_tile_plans_from_host_document_bounds_read_nothing_back(monkeypatch):
    """Issue 43, finding 10: planning the tiles read each chunk's first and last document id back from the device,
    once per micro-batch and inside every pipeline stage's forward. Given the bounds computed from the batch while
    it is in host memory, a micro-batch's plan reads nothing; a pipeline stage plans each microbatch from the bounds
    of the step's whole batch (``StageInputs``): every tile it skips, or computes without a document mask, is so
    for the microbatch's own rows, so the plan holds for them."""
    from meshtron.train.batch import StageInputs, host_document_bounds

    reads, differs = host_reads_in_tiles(monkeypatch), []
    tokens = torch.tensor(
        [
            [5, 0, 7, 8, 0, 0, 9, 9, 4, 4, 0, 3, 3, 3, 3, 0],
            [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],  # one document: full and causal tiles
            [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0],
            [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8],
        ]
    )
    for rank in (0, 1):
        split = SequenceSplit(cp=2, cp_rank=rank, mask_documents=True, eos_token_id=0)
        stage_inputs = StageInputs(split)
        with stage_inputs.during(host_document_bounds(tokens, split)):
            assert reads == []
            for rows in (slice(0, 2), slice(2, 4)):
                micro = tokens[rows]
                exact = plans.planned_tiles(sequence_inputs(micro, split)["sequence_layout"], "cpu")
                assert reads == ["tolist"]  # read back once: what every micro-batch and stage forward did
                reads.clear()
                alone = sequence_inputs(micro, split, host_document_bounds(micro, split))["sequence_layout"]
                assert plans.planned_tiles(alone, "cpu") is not None and reads == []
                assert [[t[:2] for t in tiles] for tiles in plans.planned_tiles(alone, "cpu").values()] == [
                    [t[:2] for t in tiles] for tiles in exact.values()
                ]
                stage = plans.planned_tiles(stage_inputs(micro)["sequence_layout"], "cpu")
                assert reads == []
                for source, tiles in exact.items():
                    kept = {(qi, ki): mask for qi, ki, mask in stage[source]}
                    for qi, ki, mask in tiles:  # every tile the rows need is kept, with their own mask if masked
                        got = kept[qi, ki]
                        if got is None or isinstance(got, str):  # full or causal for the batch: so for the rows
                            assert got == mask
                        elif isinstance(mask, torch.Tensor):
                            assert torch.equal(got, mask)
                        differs.append(isinstance(got, torch.Tensor) and not isinstance(mask, torch.Tensor))
        assert stage_inputs.document_bounds is None  # evaluation after the step plans from the device
    assert any(differs)  # the batch's plan is not each microbatch's own: some tile masked for all rows


def test_kernel_choice_per_device_dtype_and_mask():
    choose = tile_kernels.choose_tile_kernel
    dense = torch.ones(1, 4, 4, dtype=torch.bool)
    block_mask = plans.chunk_block_mask(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long), True)
    h100, v100 = (9, 0), (7, 0)
    assert [choose("cpu", torch.float32, 64, m) for m in (None, "causal", dense)] == ["cpu_flash", "cpu_flash", "math"]
    assert choose("cpu", torch.bfloat16, 64, None, kernel="math") == "math"
    assert choose("cuda", torch.bfloat16, 128, "causal", capability=h100) == "cuda_flash"
    assert choose(torch.device("cuda", 1), torch.float16, 128, None, capability=h100) == "cuda_flash"
    assert choose("cuda", torch.float32, 128, None, capability=h100) == "cuda_efficient"
    assert choose("cuda", torch.bfloat16, 128, None, capability=v100) == "cuda_efficient"
    assert choose("cuda", torch.bfloat16, 12, None, capability=h100) == "math"  # no fused kernel for head dim 12
    assert choose("cuda", torch.bfloat16, 128, block_mask, capability=h100) == "flex"
    assert choose("cuda", torch.bfloat16, 128, None, kernel="math", capability=h100) == "math"
    assert [
        plans.mask_kind(d, k) for d, k in [("cuda", "auto"), ("cpu", "auto"), ("cuda", "math"), ("cpu", "flex")]
    ] == ["flex", "dense", "dense", "flex"]
    with pytest.raises(ValueError, match="not one of"):
        plans.mask_kind("cpu", "sdpa")


def chunk_docs():
    """Two rows of two 18-token chunks (BlockMask blocks of 4, the last one cut): documents that end inside and
    on block borders, and a query chunk starting with the key chunk's last document, over whole blocks."""
    ends = ([2, 7, 11, 20, 23, 27, 35], [9, 30])
    tokens = torch.ones(2, 36, dtype=torch.long)
    for row, positions in enumerate(ends):
        tokens[row, positions] = 0
    docs = document_ids(tokens, 0)
    return docs[:, :18], docs[:, 18:]


@pytest.mark.parametrize("diagonal", [True, False])
def test_chunk_block_mask_lists_exactly_the_visible_blocks(diagonal):
    kv_docs, q_docs = chunk_docs()
    if diagonal:
        kv_docs = q_docs
    size, length = 4, q_docs.shape[1]
    dense = plans.dense_chunk_mask(q_docs, kv_docs, diagonal)
    expected = (q_docs[:, :, None] == kv_docs[:, None, :]) & (torch.ones(length, length).tril().bool() | (not diagonal))
    assert torch.equal(dense, expected)
    block_mask = plans.chunk_block_mask(q_docs, kv_docs, diagonal, block_size=size)
    assert torch.equal(create_mask(block_mask.mask_mod, 2, 1, length, length, device="cpu")[:, 0], dense)
    listed, full = block_mask.to_dense()[:, 0].bool(), full_blocks(block_mask)
    blocks = -(-length // size)
    for q, kv in itertools.product(range(blocks), repeat=2):
        part = dense[:, q * size : (q + 1) * size, kv * size : (kv + 1) * size]
        complete = part.shape[1:] == (size, size)
        assert torch.equal(listed[:, q, kv], part.flatten(1).any(1)), (q, kv)
        assert torch.equal(full[:, q, kv], part.flatten(1).all(1) & complete), (q, kv)
    assert full.any() and (listed & ~full).any() and not listed.all()  # every kind of block occurs


def qkv(length, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, length, 16, generator=gen).to(dtype) for heads in (4, 2, 2)]


@pytest.mark.parametrize("diagonal", [True, False])
def test_flex_tile_forward_matches_the_dense_kernel(diagonal):
    """Eager FlexAttention with the planned BlockMask (blocks of 4 and of 128) against the plain-PyTorch
    kernel with the boolean mask: output and log-sum-exp, rows without a visible key included (out 0, -inf)."""
    kv_docs, q_docs = chunk_docs()
    if diagonal:
        kv_docs = q_docs
    q, k, v = qkv(q_docs.shape[1])
    want_out, want_lse = tile_kernels.math_forward(q, k, v, plans.dense_chunk_mask(q_docs, kv_docs, diagonal), 0.3)
    assert diagonal or torch.isinf(want_lse).any()  # queries whose document starts after the key chunk
    for size in (4, 128):
        block_mask = plans.chunk_block_mask(q_docs, kv_docs, diagonal, block_size=size)
        out, lse = tile_kernels.tile_forward(q, k, v, block_mask, 0.3)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_recomputed_backward_through_the_log_sum_exp_gives_each_tile_its_share():
    """The flex backward's formula, with the differentiable plain-PyTorch forward in FlexAttention's place
    (which has no CPU backward): the shares of two masked tiles, each recomputed from the merged
    output and log-sum-exp, add up to the gradients of attention over both, in float64."""
    kv_docs, q_docs = chunk_docs()
    masks = [plans.dense_chunk_mask(q_docs, kv_docs, False), plans.dense_chunk_mask(q_docs, q_docs, True)]
    q, k0, v0 = (t.double() for t in qkv(18, seed=1))
    _, k1, v1 = (t.double() for t in qkv(18, seed=2))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k0, v0, k1, v1)]
    merged = tile_kernels.merge_partial(
        *tile_kernels.math_forward(*leaves[:3], masks[0], 0.3),
        *tile_kernels.math_forward(leaves[0], *leaves[3:], masks[1], 0.3),
    )
    merged[0].backward(grad_out)
    out, lse = (t.detach() for t in merged)
    shares = [
        fused.recomputed_backward(lambda *t, m=mask: tile_kernels.math_forward(*t, m, 0.3), q, k, v, out, lse, grad_out)
        for mask, k, v in zip(masks, (k0, k1), (v0, v1))
    ]
    torch.testing.assert_close(shares[0][0] + shares[1][0], leaves[0].grad.float(), atol=1e-6, rtol=1e-5)
    for (_, dk, dv), k_leaf, v_leaf in zip(shares, leaves[1::2], leaves[2::2]):
        torch.testing.assert_close(dk, k_leaf.grad.float(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(dv, v_leaf.grad.float(), atol=1e-6, rtol=1e-5)
    # The same shares as the plain-PyTorch backward that takes the final output and log-sum-exp.
    for share, mask, k, v in zip(shares, masks, (k0, k1), (v0, v1)):
        for got, want in zip(share, tile_kernels.tile_backward(q, k, v, mask, 0.3, out, lse, grad_out, kernel="math")):
            torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_calls_fit_the_aten_signatures(dtype):
    """Shapes through the flash / memory-efficient ops on meta tensors (their CUDA kernels cannot run here):
    argument order, grouped-query heads, the efficient kernel's padded log-sum-exp."""
    q, k, v = (t.to("meta", dtype) for t in qkv(40))
    run = [(fused.flash_forward, fused.flash_backward)] if dtype == torch.bfloat16 else []
    run.append((fused.efficient_forward, fused.efficient_backward))
    for forward, backward in run:
        out, lse = forward(q, k, v, True, 0.25)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        dq, dk, dv = backward(q, k, v, False, 0.25, out.float(), lse, out.float())[:3]
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_attention_layers_make_no_host_sync(monkeypatch):
    """Once the micro-batch's plan is made, forward and backward of every kernel path never read a tensor
    on the host (``bool(t)``, ``t.item()``, ``t.tolist()``): on a GPU each would stall the stream."""
    docs = document_ids(torch.tensor([[1, 1, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1]] * 2), 0)
    q, k, v = (t.requires_grad_() for t in qkv(16))
    for kernel in ("auto", "math"):
        layout = SequenceLayout(16, cp=1, document_ids=docs, kernel=kernel)
        plans.planned_tiles(layout, torch.device("cpu"))
        assert any(isinstance(mask, torch.Tensor) for _, _, mask in layout.attention_cache["cp", "cpu", "dense"][0])
        with monkeypatch.context() as patch:
            for name in ("__bool__", "item", "tolist"):
                patch.setattr(torch.Tensor, name, _no_sync)
            context_parallel_attention(q, k, v, layout, 0.25).sum().backward()
    with pytest.raises(AssertionError, match="host sync"), monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "__bool__", _no_sync)
        bool(q.sum() > 0)


def _no_sync(*args, **kwargs):
    raise AssertionError("host sync inside attention")


def test_planner_charges_fused_tiles_on_cuda_and_fp32_ones_elsewhere():
    """On CUDA, CP attention runs at the compute-dtype rate (a cp layout computes as long as FSDP over the
    same ranks) and its transient buffers are (chunk x head dim); on CPU the fp32 rate and scores stay."""
    from meshtron.distributed.mesh import ParallelDims
    from meshtron.models.presets import make_preset_config
    from meshtron.plan.hardware import hardware
    from meshtron.plan.layout import Layout, Workload
    from meshtron.plan.memory import estimate_memory
    from meshtron.plan.model_shape import ModelShape
    from meshtron.plan.throughput import estimate_step

    hf_config = make_preset_config("llama-1b", 259)
    shape, hw = ModelShape.from_hf_config(hf_config), hardware("h100")
    # the same rows per matmul (micro x seq / cp) and micro-batches per step, whose count the planner also charges
    cp2, fsdp2 = Layout(ParallelDims(cp=2), micro_batch=2), Layout(ParallelDims(dp_shard=2), micro_batch=1)
    runs = {d: Workload(seq_len=8192, global_batch=8, loss_chunk_size=0, device=d) for d in ("cuda", "cpu")}
    compute = {
        (d, name): estimate_step(shape, layout, w, hw, hf_config).compute_s
        for d, w in runs.items()
        for name, layout in (("cp2", cp2), ("fsdp2", fsdp2))
    }
    assert compute["cuda", "cp2"] == pytest.approx(compute["cuda", "fsdp2"], rel=1e-12)
    assert compute["cpu", "cp2"] > 1.5 * compute["cpu", "fsdp2"]  # attention FLOPs at the fp32 rate
    chunk, rows = 8192 // 4, 2 * shape.heads * 8192 // 4
    transient = {d: estimate_memory(shape, cp2, w).temporaries for d, w in runs.items()}
    assert transient["cpu"] - transient["cuda"] == 3 * 4 * rows * chunk - 4 * 4 * rows * shape.head_dim


def test_tile_benchmark_runs_every_kernel(monkeypatch):
    """``bench/context_parallel.py --tiles`` at a tiny shape on CPU: every (tile, kernel) row, meshtron's
    kernels within tolerance of the fp32 plain kernel (on a GPU it adds peak memory and the fused kernels)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    try:
        bench = importlib.import_module("context_parallel")
        args = bench.parse_args(
            ["--tiles", "--tile-len", "48", "--tile-documents", "3", "--iters", "1", "--warmup", "0"]
        )
        rows, ok = bench.tile_figures(args, torch.device("cpu"))
    finally:  # the benchmark's modules are top-level names: leave none behind
        for name in ("context_parallel", "attention_kernels", "launch"):
            sys.modules.pop(name, None)
    assert (
        ok
        and len(rows) == 9
        and {r["tile"] for r in rows} == {"causal (diagonal)", "full (off-diagonal)", "3 documents (diagonal)"}
    )
    assert all(r["rel_error"] < 1e-5 for r in rows if r["rel_error"] is not None)
    assert "| 3 documents (diagonal) | meshtron (auto) |" in bench.tiles_table(rows)


@pytest.mark.slow
def test_context_parallel_attention_matches_single_device(tmp_path):
    """Output and q/k/v gradients, cp 2 and 4, ring, all-gather, Ulysses and hybrid (cp 4, cp_ulysses 2: the ring's
    tiles planned from the host document bounds), causal and document masks, GQA, with the fastest kernel and the
    plain-PyTorch one (and FlexAttention tiles, output only), against float64 whole-sequence attention."""
    out = tmp_path / "errors.json"
    proc = run_forked(4, ["tests/cp_attention_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert len(results) == 28
    assert {len(errs) for name, errs in results.items()} == {4, 1} and all(
        len(errs) == 1 for name, errs in results.items() if name.endswith("-flex")
    )
    failures = {case: errs for case, errs in results.items() if max(errs.values()) > OP_TOLERANCE}
    print("worst relative error:", max(max(e.values()) for e in results.values()))
    assert not failures, failures
    # Sliding windows (5, 8, 16, 27 against chunks of 16 at cp=2 and 8 at cp=4), written beside: see the worker.
    windowed = json.loads((tmp_path / "errors.json.sliding_window.json").read_text())
    assert len(windowed) == 32 and sum(name.endswith("-window27") for name in windowed) == 8
    assert all(len(errs) == (1 if "-flex-" in name else 4) for name, errs in windowed.items())
    failures = {case: errs for case, errs in windowed.items() if max(errs.values()) > OP_TOLERANCE}
    print("worst relative error with a sliding window:", max(max(e.values()) for e in windowed.values()))
    assert not failures, failures
    # Hybrid (Ulysses over pairs x a ring of two at cp 4; the ends cp_ulysses 1 and 4), written beside: see the worker.
    hybrid = json.loads((tmp_path / "errors.json.hybrid.json").read_text())
    assert len(hybrid) == 9 and {name for name in hybrid if "-u2-" not in name} == {
        "cp4-hybrid-u1-documents-auto",
        "cp4-hybrid-u4-documents-auto",
    }
    assert all(len(errs) == (1 if "-flex" in name else 4) for name, errs in hybrid.items())
    failures = {case: errs for case, errs in hybrid.items() if max(errs.values()) > OP_TOLERANCE}
    print("worst relative error of hybrid attention:", max(max(e.values()) for e in hybrid.values()))
    assert not failures, failures


@pytest.mark.parametrize(
    "layout, world",
    [
        (["parallel.cp=2"], 2),
        (["parallel.pp=2", "parallel.cp=2"], 4),
        (["parallel.cp=4", "parallel.cp_method=hybrid", "parallel.cp_ulysses=2"], 4),
    ],
    ids=["cp2", "pp2_cp2", "cp4_hybrid"],
)
def test_training_plans_context_parallel_tiles_without_reading_the_device(
    layout, world, tmp_path, cache_dir, monkeypatch
):
    """Issue 43, finding 10, in training: rank 0 of a cp=2 (and of a pp=2 x cp=2, and of a hybrid cp=4: the ring of
    two across its Ulysses pairs) layout, trained alone on a fake process group, with document masks: its
    micro-batches' and its pipeline stage's forwards plan the ring's tiles from bounds computed in host memory,
    reading nothing back from the device."""
    from meshtron.config import load_config
    from meshtron.plan.rehearsal import rehearse

    reads = host_reads_in_tiles(monkeypatch)
    planned = []
    plan = plans.plan_tiles
    monkeypatch.setattr(plans, "plan_tiles", lambda *args: planned.append(args) or plan(*args))
    settings = [
        "model.preset=llama-tiny",
        *layout,
        "data.seq_len=32",
        "data.max_documents=40",
        f"data.cache_dir={cache_dir}",
        "train.global_batch_size=4",
        f"run.output_dir={tmp_path / 'run'}",
        "run.device=cpu",
        "run.progress=false",
    ]
    rehearse(load_config(None, settings, env={}), world_size=world, rank=0, steps=2)
    assert planned and all(layout.document_ids is not None for layout, *_ in planned)
    # Every plan is a ring of 2 (hybrid's: its 2 groups of cp_ulysses 2) with bounds for its 4 chunks (hybrid's
    # derived from the 8 cp chunks').
    assert all(layout.cp == 2 and len(layout.document_bounds[0][0]) == 4 for layout, *_ in planned)
    assert reads == []


def test_hybrid_is_refused_where_torch_cannot_split_the_cp_mesh(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    from meshtron.distributed.layout_checks import check_mesh_unflatten
    from meshtron.errors import ConfigError

    check_mesh_unflatten()  # torch 2.13 has it
    monkeypatch.delattr(DeviceMesh, "_unflatten")
    with pytest.raises(ConfigError, match=r"parallel.cp_method=hybrid needs DeviceMesh._unflatten"):
        check_mesh_unflatten()
