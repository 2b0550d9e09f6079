"""Sliding-window attention in meshtron's attention: with document masks, single device and context parallel.

A query at index i sees a key at index j iff j <= i, i - j < window (transformers' ``sliding_window_overlay``:
kv_idx > q_idx - sliding_window) and both are in the same document. The multi-process CP cases (ring and
all-gather, cp 2 and 4) run in ``tests/cp_attention_worker.py`` with the other CP attention cases; here the
CP tiles are checked in one process by running every rank's share of the computation in turn.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from conftest import each_document_alone, full_blocks, reference_attention
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from meshtron.distributed.context_parallel import SequenceLayout, hf_attention, local_token_index, register_attention
from meshtron.distributed.context_parallel import tiles as plans
from meshtron.distributed.context_parallel.layout import chunk_ids
from meshtron.distributed.context_parallel.ring import _backward_tiles, _forward_tiles, _halves, _own_first
from meshtron.distributed.context_parallel.tile_kernels import add_sinks, sink_gradient
from meshtron.models import attention_kernels as kernels
from meshtron.models.attention import document_ids
from meshtron.train.batch import SequenceSplit, sequence_inputs

EOS = 0
SEQ = 300  # not a multiple of the 128-token block
# Shorter than, equal to and longer than a 128-token block; the sequence length and beyond (no window).
WINDOWS = [1, 5, 64, 127, 128, 129, 200, 299, 300, 1000]


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def packed_tokens(seq: int = SEQ) -> torch.Tensor:
    """Row 0: documents ending across and on 128-token block borders; row 1: short documents, then a long
    one; row 2: one document."""
    tokens = torch.randint(1, 100, (3, seq), generator=torch.Generator().manual_seed(0))
    tokens[0, [e for e in (5, 127, 128, 200, 299) if e < seq]] = EOS
    tokens[1, [e for e in (40, 41, 100, 255, 256) if e < seq]] = EOS
    return tokens


def naive_mask(tokens: torch.Tensor | None, window: int | None, seq: int | None = None) -> torch.Tensor:
    """(B, S, S) bool, query by query: the keys from the later of its document's start and i - window + 1 up to
    i. ``tokens`` None: one document, batch 1."""
    if tokens is None:
        tokens = torch.ones(1, seq, dtype=torch.long)
    batch, seq = tokens.shape
    visible = torch.zeros(batch, seq, seq, dtype=torch.bool)
    for row in range(batch):
        start = 0
        for i in range(seq):
            lowest = start if window is None else max(start, i - window + 1)
            visible[row, i, lowest : i + 1] = True
            if tokens[row, i] == EOS:
                start = i + 1
    return visible


def qkv(batch=3, seq=SEQ, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, 16, generator=gen).to(dtype) for heads in (4, 2, 2)]


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().to(grad_out.dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def _maybe(window):
    return None if window >= SEQ else window


# --- the masks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 7, 16])
def test_one_document_mask_is_transformers_sliding_window_causal_mask(window):
    from transformers.masking_utils import sliding_window_causal_mask_function

    index = torch.arange(20)
    theirs = sliding_window_causal_mask_function(window)(0, 0, index[:, None], index[None, :])
    ours = kernels.dense_document_mask(None, "cpu", window, 20)[0, 0]
    assert torch.equal(ours, theirs)
    assert torch.equal(create_mask(kernels.document_mask_mod(None, window), 1, 1, 20, 20, device="cpu")[0, 0], theirs)


@pytest.mark.parametrize("window", WINDOWS)
def test_dense_mask_and_mask_mod_match_the_naive_mask(window):
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS)
    window = kernels.effective_window(window, SEQ)
    expected = naive_mask(tokens, window)
    assert torch.equal(kernels.dense_document_mask(docs, "cpu", window)[:, 0], expected)
    assert torch.equal(
        create_mask(kernels.document_mask_mod(docs, window), 3, 1, SEQ, SEQ, device="cpu")[:, 0], expected
    )
    if window is not None:
        assert torch.equal(kernels.dense_document_mask(None, "cpu", window, SEQ)[:, 0], naive_mask(None, window, SEQ))


def test_window_of_the_sequence_length_or_more_is_none():
    assert [kernels.effective_window(w, SEQ) for w in (None, 1, 299, 300, 4096)] == [None, 1, 299, None, None]
    with pytest.raises(ValueError, match="at least 1"):
        kernels.effective_window(0, SEQ)


@pytest.mark.parametrize("block_size", [128, 16])
@pytest.mark.parametrize("with_documents", [True, False])
@pytest.mark.parametrize("window", [1, 5, 16, 64, 127, 128, 129, 200, 299])
def test_block_mask_skips_blocks_outside_the_window(window, with_documents, block_size):
    """Listed blocks are exactly those with a visible pair, full blocks those where every pair is visible
    (never a partly windowed one); the same as torch's ``create_block_mask`` evaluating every position."""
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS) if with_documents else None
    ours = kernels.document_block_mask(docs, "cpu", SEQ, block_size, window)
    batch = 3 if with_documents else 1
    torchs = create_block_mask(
        kernels.document_mask_mod(docs, window), batch, 1, SEQ, SEQ, device="cpu", BLOCK_SIZE=block_size
    )
    assert torch.equal(ours.to_dense(), torchs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, torchs.full_kv_num_blocks)
    dense = naive_mask(tokens if with_documents else None, window, SEQ)
    assert torch.equal(create_mask(ours.mask_mod, batch, 1, SEQ, SEQ, device="cpu")[:, 0], dense)
    listed, full = ours.to_dense()[:, 0].bool(), full_blocks(ours)
    blocks = -(-SEQ // block_size)
    for q, kv in itertools.product(range(blocks), repeat=2):
        part = dense[:, q * block_size : (q + 1) * block_size, kv * block_size : (kv + 1) * block_size]
        complete = part.shape[1:] == (block_size, block_size)
        assert torch.equal(listed[:, q, kv], part.flatten(1).any(1)), (q, kv)
        assert torch.equal(full[:, q, kv], part.flatten(1).all(1) & complete), (q, kv)
    if (blocks - 1) * block_size - (block_size - 1) >= window:  # the last query block is beyond the first key block
        assert not listed[:, -1, 0].any()


# --- single-device attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("with_documents", [True, False])
@pytest.mark.parametrize("window", [1, 5, 64, 128, 129, 299, 300])
def test_output_matches_reference_attention(window, with_documents, kernel):
    """Eager FlexAttention (its unfused CPU reference) and SDPA with the dense mask, GQA 4 / 2 heads."""
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS) if with_documents else None
    visible = naive_mask(tokens if with_documents else None, _maybe(window), SEQ)
    q, k, v = qkv()
    out = kernels.document_attention(q, k, v, docs, 0.3, kernel=kernel, window=window)
    want = reference_attention(q, k, v, visible.expand(3, -1, -1), 0.3)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 64, 129])
def test_sdpa_gradients_match_reference_attention(window):
    """FlexAttention has no CPU backward (see test_attention_kernels): SDPA's gradients here."""
    tokens = packed_tokens()[:2]
    docs, visible = document_ids(tokens, EOS), naive_mask(tokens, window)
    base = qkv(batch=2)
    grad_out = torch.randn(base[0].shape, generator=torch.Generator().manual_seed(2))
    expected = _grads(lambda q, k, v: reference_attention(q, k, v, visible, 0.3), base, grad_out.double())
    got = _grads(
        lambda q, k, v: kernels.document_attention(q, k, v, docs, 0.3, kernel="sdpa", window=window), base, grad_out
    )
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_masks_are_cached_per_window():
    """Full and sliding layers alternate: one mask per window and micro-batch, built before the model runs
    (``prepare_masks``) or on first use; a window of the sequence length or more shares the full layers' mask."""
    docs = document_ids(packed_tokens(), EOS)
    layout = SequenceLayout(SEQ, document_ids=docs)
    q, k, v = qkv()
    for kernel in ("sdpa", "flex"):
        outs = {
            w: kernels.document_attention(q, k, v, docs, 0.3, kernel=kernel, cache=layout.attention_cache, window=w)
            for w in (None, 16, None, 16, SEQ)
        }
        assert not torch.equal(outs[None], outs[16]) and torch.equal(outs[None], outs[SEQ])
    assert set(layout.attention_cache) == {
        ("dense", "cpu", SEQ),
        ("dense", "cpu", SEQ, 16),
        ("flex", "cpu", SEQ),
        ("flex", "cpu", SEQ, 16),
    }
    cache = {}
    kernels.prepare_masks(cache, docs, torch.device("cpu"), SEQ, windows=(None, 16, 4096))
    assert set(cache) == {("dense", "cpu", SEQ), ("dense", "cpu", SEQ, 16)}
    assert torch.equal(cache["dense", "cpu", SEQ, 16], layout.attention_cache["dense", "cpu", SEQ, 16])
    cache = {}
    kernels.prepare_masks(cache, None, torch.device("cpu"), SEQ, windows=(None, 16))
    assert list(cache) == [("dense", "cpu", SEQ, 16)]  # no documents, no window: SDPA's causal mode


def test_hf_attention_takes_the_layers_sliding_window():
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS)
    q, k, v = qkv()
    layout = SequenceLayout(SEQ, document_ids=docs)
    for window in (None, 7):
        out, weights = hf_attention(None, q, k, v, None, scaling=0.3, sequence_layout=layout, sliding_window=window)
        assert weights is None and out.shape == (3, SEQ, 4, 16)
        want = reference_attention(q, k, v, naive_mask(tokens, window), 0.3)
        torch.testing.assert_close(out.transpose(1, 2).double(), want, atol=1e-5, rtol=1e-5)


# --- models: meshtron's attention against the model's own ------------------------------------------------------


def _tiny(family: str, window: int):
    import transformers

    common = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=window,
        attention_dropout=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=EOS,
    )
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"]
        )
        model = transformers.Gemma3ForCausalLM(config)
    elif family == "gemma2":  # soft-capped attention scores (a cap of 1 binds on most scores)
        config = transformers.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0,
        )
        model = transformers.Gemma2ForCausalLM(config)
    elif family == "gpt_oss":  # attention sinks (meshtron's attention adds them as transformers' eager does)
        config = transformers.GptOssConfig(
            **{**common, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = transformers.GptOssForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**common)
        model = transformers.MistralForCausalLM(config)
    torch.manual_seed(0)
    model.apply(model._init_weights)
    if family == "gpt_oss":  # sinks of weight comparable to the scores' (they start at ~0.02)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    if family == "gemma2":  # scores large enough for the cap of 1 to bind (the initial ones are ~0.01)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(30)
                layer.self_attn.k_proj.weight.mul_(30)
    return model.eval()


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "mistral", "qwen2", "gpt_oss"])
def test_packed_documents_match_each_document_alone_with_the_models_own_attention(family):
    """Packed documents with meshtron's attention (document mask and window) give the logits of each document
    run alone through the model's eager attention with transformers' own sliding-window mask. Gemma 3
    alternates a sliding and a full layer; Gemma 2 too, and caps its attention scores (meshtron's attention caps
    them as transformers' eager attention does: without the cap the logits differ); Qwen2 slides from layer
    ``max_window_layers`` on (its layer_types); gpt-oss alternates too and adds its attention sinks to every
    softmax (meshtron's attention as transformers' eager one: without them the logits differ)."""
    window = 5
    model = _tiny(family, window)
    if family == "qwen2":
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
    tokens = torch.randint(1, 100, (2, 40), generator=torch.Generator().manual_seed(3))
    tokens[0, [3, 17, 18, 30]] = EOS  # documents of 4, 14, 1, 12 and 9 tokens; row 1: one document
    with torch.no_grad():
        model.set_attn_implementation("eager")
        alone = each_document_alone(model, tokens, EOS)
        model.set_attn_implementation(register_attention())
        packed = model(**sequence_inputs(tokens, SequenceSplit(mask_documents=True, eos_token_id=EOS))).logits
        if family == "gemma2":  # the cap matters
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            uncapped = model(**sequence_inputs(tokens, SequenceSplit(mask_documents=True, eos_token_id=EOS))).logits
            assert (uncapped - packed).abs().max() > 1e-3
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = 1.0
        if family == "gpt_oss":  # the sinks matter
            sinks = [layer.self_attn.sinks.clone() for layer in model.model.layers]
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
            sinkless = model(**sequence_inputs(tokens, SequenceSplit(mask_documents=True, eos_token_id=EOS))).logits
            assert (sinkless - packed).abs().max() > 1e-3
            for layer, sink in zip(model.model.layers, sinks):
                layer.self_attn.sinks.copy_(sink)
        # The window matters: without it the packed logits differ.
        model.config.sliding_window = None
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        unwindowed = model(**sequence_inputs(tokens, SequenceSplit(mask_documents=True, eos_token_id=EOS))).logits
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert (unwindowed - packed).abs().max() > 1e-3


# --- context parallelism: tiles on global indices --------------------------------------------------------------


def test_tiles_are_classified_by_the_window_on_global_indices():
    """Chunks of 4 (cp=2, 16 tokens): (query chunk, key chunk) pairs 4 apart hold distances 1..7, 8 apart 5..11;
    the diagonal 0..3."""
    chunk = 4
    kinds = {
        w: {(q, kv): plans.classify(None, None, q, kv, w, chunk) for q, kv in itertools.product(range(4), repeat=2)}
        for w in (1, 3, 4, 5, 8, 12)
    }
    assert kinds[1][0, 0] == kinds[3][1, 1] == "masked"  # the diagonal's distances reach 3
    assert kinds[4][0, 0] == kinds[5][2, 2] == "causal"
    assert kinds[1][1, 0] == "skip" and kinds[3][1, 0] == kinds[4][1, 0] == kinds[5][1, 0] == "masked"
    assert kinds[8][1, 0] == "full" and kinds[5][2, 0] == "skip" and kinds[8][2, 0] == "masked"
    assert kinds[12][2, 0] == "full" and kinds[8][3, 0] == "skip" and kinds[12][3, 0] == "masked"
    assert all(kinds[w][0, 1] == "skip" for w in kinds)  # the future
    docs = torch.tensor([[0] * 6 + [1] * 10])
    ends = docs.reshape(1, 4, 4)
    first, last = ends[:, :, 0].tolist(), ends[:, :, -1].tolist()
    assert plans.classify(first, last, 3, 2) == "full"  # one document spans both chunks
    assert plans.classify(first, last, 3, 2, 4, chunk) == "masked"  # but the window cuts it
    assert plans.classify(first, last, 3, 2, 8, chunk) == "full"
    assert (
        plans.classify(first, last, 2, 2, 4, chunk) == "causal"
        and plans.classify(first, last, 2, 2, 3, chunk) == "masked"
    )
    assert plans.classify(first, last, 2, 0, 8, chunk) == "skip"  # an earlier document only, window or not


@pytest.mark.parametrize("with_documents", [True, False])
@pytest.mark.parametrize("window", [1, 3, 4, 6, 9, 13])
@pytest.mark.parametrize("diagonal", [True, False])
def test_chunk_masks_apply_the_window_at_the_chunks_offset(diagonal, window, with_documents):
    """The dense tile mask, the BlockMask's blocks (of 4) and its mask_mod against the whole-sequence naive
    mask cut at the chunks' global offsets (query chunk 3, key chunk 2 or 3 of 8-token chunks); without
    documents (masked by the window only) both have batch 1."""
    tokens = torch.ones(2, 32, dtype=torch.long)
    tokens[0, [20, 27]] = EOS
    tokens[1, [13, 25, 26]] = EOS
    docs = document_ids(tokens, EOS)
    c, q_chunk = 8, 3
    kv_chunk = q_chunk if diagonal else 2
    whole = naive_mask(tokens if with_documents else None, window, 32)
    expected = whole[:, q_chunk * c : (q_chunk + 1) * c, kv_chunk * c : (kv_chunk + 1) * c]
    q_docs, kv_docs = docs[:, q_chunk * c : (q_chunk + 1) * c], docs[:, kv_chunk * c : (kv_chunk + 1) * c]
    if not with_documents:
        q_docs = kv_docs = None
    offset = (q_chunk - kv_chunk) * c
    dense = plans.dense_chunk_mask(q_docs, kv_docs, diagonal, window=window, offset=offset, length=c)
    assert torch.equal(dense, expected)
    size = 4
    block_mask = plans.chunk_block_mask(q_docs, kv_docs, diagonal, size, window=window, offset=offset, length=c)
    batch = expected.shape[0]
    assert torch.equal(create_mask(block_mask.mask_mod, batch, 1, c, c, device="cpu")[:, 0], expected)
    listed, full = block_mask.to_dense()[:, 0].bool(), full_blocks(block_mask)
    assert listed.shape[0] == batch
    for q, kv in itertools.product(range(c // size), repeat=2):
        part = expected[:, q * size : (q + 1) * size, kv * size : (kv + 1) * size]
        assert torch.equal(listed[:, q, kv], part.flatten(1).any(1)), (q, kv)
        assert torch.equal(full[:, q, kv], part.flatten(1).all(1)), (q, kv)


def test_plans_are_cached_per_window_and_read_document_ranges_once(monkeypatch):
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9, 9, 4, 4, 0, 3, 3, 3, 3, 0]])
    split = SequenceSplit(cp=2, cp_rank=1, mask_documents=True, eos_token_id=0)
    layout = sequence_inputs(tokens, split)["sequence_layout"]
    assert list(layout.attention_cache) == [("cp", "cpu", "dense")]
    with monkeypatch.context() as patch:  # a later layer's window: no host sync
        patch.setattr(torch.Tensor, "tolist", lambda *a: (_ for _ in ()).throw(AssertionError("host sync")))
        windowed = plans.planned_tiles(layout, torch.device("cpu"), 3)
        assert plans.planned_tiles(layout, torch.device("cpu"), 3) is windowed
        assert plans.planned_tiles(layout, torch.device("cpu"), 16) is layout.attention_cache["cp", "cpu", "dense"]
    assert list(layout.attention_cache) == [("cp", "cpu", "dense"), ("cp", "cpu", "dense", 3)]
    # rank 1 holds chunks 1 and 2 (of 4 tokens), rank 0 chunks 0 and 3: with window 3 the pair of chunks 2 and 0
    # (distances 5 to 11) is skipped, those 4 apart are masked
    assert [(qi, ki) for qi, ki, _ in windowed[1]] == [(0, 0), (1, 0), (1, 1)]
    assert [(qi, ki) for qi, ki, _ in windowed[0]] == [(0, 0)]
    assert all(isinstance(mask, torch.Tensor) for tiles in windowed.values() for _, _, mask in tiles)


def emulated_context_parallel(q, k, v, docs, cp, window, kernel, scale, grad_out, sinks=None):
    """Every rank's share of CP attention in one process, from the plan each rank makes: each rank's queries
    against every rank's K/V (as all-gather does), then the backward of every tile. Returns the output
    and the q/k/v gradients in global order; with ``sinks`` (gpt-oss), merged into each rank's final
    log-sum-exp as the ring does, also their gradient summed over the ranks."""
    seq = q.shape[2]
    c = seq // (2 * cp)
    index = [local_token_index(seq, cp, r) for r in range(cp)]
    kv = [torch.stack([k[:, :, i], v[:, :, i]]) for i in index]
    out, dq = torch.zeros(q.shape), torch.zeros(q.shape)
    dkv = torch.zeros(2, *k.shape)
    dsinks = 0
    for rank in range(cp):
        layout = SequenceLayout(seq, cp, rank, None, "allgather", docs, kernel)
        q_halves = _halves(q[:, :, index[rank]], c)
        state = [(torch.zeros(h.shape), torch.full(h.shape[:-1], float("-inf"))) for h in q_halves]
        for source in _own_first(layout):
            _forward_tiles(q_halves, kv[source], source, layout, scale, state, window)
        local_out, local_lse = torch.cat([s[0] for s in state], 2), torch.cat([s[1] for s in state], 2)
        if sinks is not None:
            local_out, local_lse = add_sinks(local_out, local_lse, sinks)
            dsinks = dsinks + sink_gradient(local_out, local_lse, grad_out[:, :, index[rank]], sinks)
        out[:, :, index[rank]] = local_out
        dq_halves = [torch.zeros(h.shape) for h in q_halves]
        for source in range(cp):
            grads = _backward_tiles(
                q_halves,
                kv[source],
                source,
                layout,
                scale,
                _halves(local_out, c),
                _halves(local_lse, c),
                _halves(grad_out[:, :, index[rank]], c),
                dq_halves,
                window,
            )
            dkv[:, :, :, index[source]] += grads
        dq[:, :, index[rank]] = torch.cat(dq_halves, 2)
    return (out, dq, dkv[0], dkv[1]) + (() if sinks is None else (dsinks,))


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_sinks_merge_into_the_final_log_sum_exp(cp):
    """gpt-oss's attention sinks under ring / all-gather: one more term of each query's final log-sum-exp
    (``add_sinks``); the tiles' backward on the sink-inclusive output gives q/k/v gradients, ``sink_gradient`` the
    sinks', equal to float64 attention with the sinks concatenated (documents and a window crossing chunks)."""
    seq = 48
    tokens = packed_tokens(seq)
    tokens[0, [9, 10, 22, 35]] = EOS
    docs = document_ids(tokens, EOS)
    q, k, v = qkv(seq=seq)
    sinks = torch.tensor([-1.0, 0.0, 1.0, 3.0])
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    window = seq // (2 * cp) + 3
    visible = naive_mask(tokens, window, seq).expand(3, -1, -1)

    def reference(q, k, v, sinks):
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~visible[:, None], float("-inf"))
        sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v

    want = _grads(reference, (q, k, v, sinks), grad_out.double())
    got = emulated_context_parallel(q, k, v, docs, cp, window, "auto", 0.3, grad_out, sinks)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)
    assert (got[4].abs() > 1e-3).all()  # every head's sink takes a gradient


@pytest.mark.parametrize("kernel", ["auto", "math"])
@pytest.mark.parametrize("with_documents", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_tiles_match_single_device_attention(cp, with_documents, kernel):
    """Output and q/k/v gradients for windows shorter than, equal to and longer than a chunk (48 tokens: chunks
    of 12 at cp=2, 6 at cp=4), with documents crossing chunk borders inside the window; and that windows skip
    tiles."""
    seq = 48
    tokens = packed_tokens(seq)
    tokens[0, [9, 10, 22, 35]] = EOS
    docs = document_ids(tokens, EOS) if with_documents else None
    q, k, v = qkv(seq=seq)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    chunk = seq // (2 * cp)
    for window in (1, chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk + 2, seq - 1, None):
        visible = naive_mask(tokens if with_documents else None, window, seq).expand(3, -1, -1)
        want = _grads(lambda q, k, v: reference_attention(q, k, v, visible, 0.3), (q, k, v), grad_out.double())
        got = emulated_context_parallel(q, k, v, docs, cp, window, kernel, 0.3, grad_out)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{window} {name}: {m}")
    computed = {
        w: sum(
            len(tiles)
            for r in range(cp)
            for tiles in plans.plan_tiles(SequenceLayout(seq, cp, r, document_ids=docs), "cpu", w).values()
        )
        for w in (None, chunk)
    }
    assert computed[chunk] < computed[None]


@pytest.mark.parametrize("with_documents", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_flex_tiles_forward(cp, with_documents):
    """FlexAttention tiles (forced on CPU: eager, forward only) with windows, against the reference
    (without documents the window-masked tiles have a batch-1 BlockMask)."""
    seq = 48
    tokens = packed_tokens(seq)
    tokens[0, [9, 10, 22, 35]] = EOS
    docs = document_ids(tokens, EOS) if with_documents else None
    q, k, v = qkv(seq=seq)
    chunk = seq // (2 * cp)
    for window in (1, chunk, chunk + 1, 3 * chunk + 2):
        visible = naive_mask(tokens if with_documents else None, window, seq).expand(3, -1, -1)
        want = reference_attention(q, k, v, visible, 0.3)
        for rank in range(cp):
            layout = SequenceLayout(seq, cp, rank, None, "allgather", docs, "flex")
            index = [local_token_index(seq, cp, r) for r in range(cp)]
            q_halves = _halves(q[:, :, index[rank]], chunk)
            state = [(torch.zeros(h.shape), torch.full(h.shape[:-1], float("-inf"))) for h in q_halves]
            for source in _own_first(layout):
                kv = torch.stack([k[:, :, index[source]], v[:, :, index[source]]])
                _forward_tiles(q_halves, kv, source, layout, 0.3, state, window)
            out = torch.cat([s[0] for s in state], 2)
            torch.testing.assert_close(out.double(), want[:, :, index[rank]], atol=1e-5, rtol=1e-5)
            assert chunk_ids(cp, rank) == (rank, 2 * cp - 1 - rank)
