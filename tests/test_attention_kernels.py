"""Whole-sequence attention kernels: document masks, the FlexAttention block mask, the per-device choice."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import full_blocks, reference_attention
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from meshtron.config import ModelConfig
from meshtron.distributed.context_parallel import SequenceLayout, register_attention
from meshtron.models import attention_kernels as kernels
from meshtron.models.attention import document_ids
from meshtron.models.build import build_meta_model, load_hf_config, materialize
from meshtron.train.batch import SequenceSplit, sequence_inputs

EOS = 0
SEQ = 300  # not a multiple of the 128-token block
BLOCK = kernels.BLOCK_SIZE


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    # Eager flex_attention warns that it is the unfused reference; that is what the CPU tests want.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def packed_tokens() -> torch.Tensor:
    """Row 0: documents ending across and on 128-token block borders; row 1: short documents, then a long
    one over several blocks; row 2: one document."""
    tokens = torch.randint(1, 100, (3, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[0, [5, 127, 128, 200, 299]] = EOS
    tokens[1, [40, 41, 100, 255, 256]] = EOS
    return tokens


def reference_mask(tokens: torch.Tensor) -> torch.Tensor:
    """(B, S, S) bool built document by document from the EOS positions: causal inside each document."""
    batch, seq = tokens.shape
    visible = torch.zeros(batch, seq, seq, dtype=torch.bool)
    for row in range(batch):
        ends = (tokens[row] == EOS).nonzero().flatten().tolist()
        start = 0
        for end in [e + 1 for e in ends] + [seq]:
            visible[row, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
            start = end
    return visible


def qkv(dtype=torch.float32, batch=3, seq=SEQ):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, heads, seq, 16, generator=gen).to(dtype) for heads in (4, 2, 2)]


def test_mask_mod_and_dense_mask_match_the_documents():
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS)
    expected = reference_mask(tokens)
    assert torch.equal(create_mask(kernels.document_mask_mod(docs), 3, 1, SEQ, SEQ, device="cpu")[:, 0], expected)
    assert torch.equal(kernels.dense_document_mask(docs, "cpu")[:, 0], expected)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    assert torch.equal(create_mask(kernels.document_mask_mod(None), 1, 1, SEQ, SEQ, device="cpu")[0, 0], causal)


@pytest.mark.parametrize("with_documents", [True, False])
def test_block_mask_lists_exactly_the_visible_blocks(with_documents):
    """Built from per-block document ranges, the block mask equals torch's ``create_block_mask`` (which
    evaluates every position) and each 128 x 128 block is skipped / full / partial as the dense mask says."""
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS) if with_documents else None
    ours = kernels.document_block_mask(docs, "cpu", SEQ)
    torchs = create_block_mask(kernels.document_mask_mod(docs), 3 if with_documents else 1, 1, SEQ, SEQ, device="cpu")
    assert ours.shape == torchs.shape and ours.BLOCK_SIZE == (BLOCK, BLOCK)
    assert torch.equal(ours.to_dense(), torchs.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, torchs.full_kv_num_blocks)

    dense = reference_mask(tokens) if with_documents else torch.ones(1, SEQ, SEQ, dtype=torch.bool).tril()
    blocks = -(-SEQ // BLOCK)
    listed, full = ours.to_dense()[:, 0].bool(), full_blocks(ours)
    for q in range(blocks):
        for kv in range(blocks):
            part = dense[:, q * BLOCK : (q + 1) * BLOCK, kv * BLOCK : (kv + 1) * BLOCK]
            complete = part.shape[1:] == (BLOCK, BLOCK)
            assert torch.equal(listed[:, q, kv], part.flatten(1).any(1))
            assert torch.equal(full[:, q, kv], part.flatten(1).all(1) & complete)
    if with_documents:
        assert not listed[0, 2, 0]  # row 0: the documents of block 0 end before block 2 starts
        # The one-document row: an earlier block needs no mask_mod, except in the last (cut) query block.
        assert full[2, 1, 0] and not full[2, 2, 0] and listed[2, 2, 0]


@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
@pytest.mark.parametrize("with_documents", [True, False])
def test_output_matches_reference_attention(kernel, with_documents):
    """FlexAttention runs eagerly here (its unfused reference on CPU); GQA with 4 query and 2 key heads."""
    tokens = packed_tokens()
    docs = document_ids(tokens, EOS) if with_documents else None
    visible = reference_mask(tokens) if with_documents else torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None]
    q, k, v = qkv()
    out = kernels.document_attention(q, k, v, docs, 0.3, kernel=kernel)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, visible, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flex_in_half_precision_matches_sdpa(dtype):
    docs = document_ids(packed_tokens(), EOS)
    q, k, v = qkv(dtype)
    flex = kernels.document_attention(q, k, v, docs, 0.25, kernel="flex")
    sdpa = kernels.document_attention(q, k, v, docs, 0.25, kernel="sdpa")
    assert flex.dtype == dtype
    torch.testing.assert_close(flex.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_gradients_match_reference_attention():
    """Gradients of q, k, v against float64 attention, for each kernel that has a backward on this device.

    On CPU only SDPA does: FlexAttention refuses inputs that require grad on CPU (``flex_attention``'s
    device check raises NotImplementedError "FlexAttention does not support backward on CPU" in torch
    2.11 to 2.13), so the flex gradients are compared on a GPU, by ``bench/attention_kernels.py``. If a
    later torch adds the CPU backward, the flex case below runs instead of skipping."""
    tokens = packed_tokens()
    docs, visible = document_ids(tokens, EOS), reference_mask(tokens)
    base = qkv(batch=2)
    docs, visible = docs[:2], visible[:2]
    grad_out = torch.randn(base[0].shape, generator=torch.Generator().manual_seed(2))
    expected = _grads(lambda q, k, v: reference_attention(q, k, v, visible, 0.3), base, grad_out.double())
    skipped = []
    for kernel in ("sdpa", "flex"):
        try:
            attend = lambda q, k, v: kernels.document_attention(q, k, v, docs, 0.3, kernel=kernel)  # noqa: E731
            grads = _grads(attend, base, grad_out)
        except NotImplementedError as err:
            assert kernel == "flex" and "backward on CPU" in str(err)
            skipped.append(kernel)
            continue
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if skipped:
        pytest.skip("FlexAttention has no CPU backward in this torch: flex gradients are checked on GPU only")


def _grads(fn, inputs, grad_out):
    leaves = [t.detach().to(grad_out.dtype).requires_grad_() for t in inputs]
    fn(*leaves).backward(grad_out)
    return [t.grad for t in leaves]


def test_auto_picks_sdpa_on_cpu_and_flex_on_cuda(monkeypatch):
    assert kernels.choose_kernel(torch.device("cpu")) == "sdpa"
    assert kernels.choose_kernel(torch.device("cuda", 0)) == "flex"
    assert kernels.choose_kernel("cuda") == "flex"
    used = []
    monkeypatch.setattr(kernels, "_flex_attention", lambda *args: used.append("flex"))
    q, k, v = qkv(seq=16)
    kernels.document_attention(q, k, v, None, 0.25)
    assert used == []
    kernels.document_attention(q, k, v, None, 0.25, kernel="flex")
    assert used == ["flex"]
    with pytest.raises(ValueError, match="not one of"):
        kernels.document_attention(q, k, v, None, 0.25, kernel="math")


def test_masks_are_built_once_per_layout(monkeypatch):
    """Every layer of a 2-layer model gets the micro-batch's one SequenceLayout: one mask build per
    forward, for the flex block mask (forced on CPU, forward only) and for the SDPA dense mask."""
    builds = []
    for name in ("document_block_mask", "dense_document_mask"):
        build = getattr(kernels, name)
        counted = lambda *args, _build=build, _name=name: builds.append(_name) or _build(*args)  # noqa: E731
        monkeypatch.setattr(kernels, name, counted)
    model = _tiny_model()
    assert model.config.num_hidden_layers == 2
    split = SequenceSplit(mask_documents=True, eos_token_id=EOS)
    tokens = packed_tokens()[:2, :160]
    sdpa_logits = model(**sequence_inputs(tokens, split)).logits
    sdpa_logits.sum().backward()
    assert builds == ["dense_document_mask"]
    monkeypatch.setattr(kernels, "choose_kernel", lambda device: "flex")
    with torch.no_grad():
        for _ in range(2):
            flex_logits = model(**sequence_inputs(tokens, split)).logits
    assert builds == ["dense_document_mask", "document_block_mask", "document_block_mask"]
    torch.testing.assert_close(flex_logits, sdpa_logits.detach(), atol=1e-5, rtol=1e-5)


def test_cache_is_per_layout_and_device():
    docs = document_ids(packed_tokens(), EOS)
    layout = SequenceLayout(SEQ, document_ids=docs)
    q, k, v = qkv()
    first = kernels.document_attention(q, k, v, docs, 0.25, kernel="flex", cache=layout.attention_cache)
    block_mask = layout.attention_cache[("flex", "cpu", SEQ)]
    again = kernels.document_attention(q, k, v, docs, 0.25, kernel="flex", cache=layout.attention_cache)
    assert torch.equal(first, again) and layout.attention_cache[("flex", "cpu", SEQ)] is block_mask
    fresh = SequenceLayout(SEQ, document_ids=docs)
    assert fresh.attention_cache == {}
    assert layout == fresh and hash(layout) == hash(fresh)  # the cache takes no part in comparisons
    assert "attention_cache" not in repr(layout)


def _tiny_model():
    cfg = ModelConfig(preset="llama-tiny")
    model, adapter = build_meta_model(load_hf_config(cfg, 257), cfg)
    materialize(model, adapter, torch.device("cpu"), seed=0)
    adapter.use_attention(model, register_attention())
    return model


@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
def test_soft_capped_scores_match_float64_attention(kernel):
    """Gemma 2's attn_logit_softcapping (cap 2 on scores up to ~10, so it binds): ``softcap * tanh(score /
    softcap)`` before the mask, by FlexAttention's score_mod and by the plain math that replaces SDPA (which cannot
    cap); the plain one's q/k/v gradients too, against float64 autograd."""
    tokens = packed_tokens()
    docs, visible = document_ids(tokens, EOS), reference_mask(tokens)
    q, k, v = (t * 3 for t in qkv())
    inputs = [t.clone().requires_grad_(kernel == "sdpa") for t in (q, k, v)]
    out = kernels.document_attention(*inputs, docs, 0.3, kernel=kernel, softcap=2.0)

    def reference(q, k, v):
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        scores = torch.tanh(q @ k.transpose(-1, -2) * 0.3 / 2.0) * 2.0
        return torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ v

    reference_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    want = reference(*reference_inputs)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    uncapped = reference_attention(q, k, v, visible, 0.3)
    assert (uncapped - want).abs().max() > 1e-2  # the cap binds
    if kernel == "sdpa":
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        got = torch.autograd.grad(out, inputs, grad)
        wanted = torch.autograd.grad(want, reference_inputs, grad.double())
        for name, a, b in zip("qkv", got, wanted):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kernel", ["flex", "sdpa"])
def test_attention_sinks_match_float64_attention(kernel):
    """gpt-oss's attention sinks: a logit per head in the softmax's denominator that attends to no value, with a
    sliding window and document masks, as transformers' eager attention (concatenate, softmax, drop) computes it in
    float64: by the plain math that replaces SDPA (q/k/v and sink gradients too) and by FlexAttention with the
    log-sum-exp correction (``sink_correction``, the CUDA path; here FlexAttention's eager CPU reference)."""
    tokens = packed_tokens()
    window = 40
    docs = document_ids(tokens, EOS)
    visible = reference_mask(tokens) & kernels.dense_document_mask(None, "cpu", window, SEQ)[0]
    q, k, v = (t.double() for t in qkv())
    sinks = torch.tensor([-1.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    inputs = [t.clone().requires_grad_(kernel == "sdpa") for t in (q, k, v, sinks)]  # flex: no CPU backward
    out = kernels.document_attention(*inputs[:3], docs, 0.3, kernel=kernel, window=window, sinks=inputs[3])

    def reference(q, k, v, sinks):
        k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~visible[:, None], float("-inf"))
        sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v

    reference_inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    want = reference(*reference_inputs)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    without = kernels.document_attention(q, k, v, docs, 0.3, kernel="sdpa", window=window)
    assert (without - want).abs().max() > 1e-2  # the sinks matter
    if kernel == "sdpa":
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        got = torch.autograd.grad(out, inputs, grad)
        wanted = torch.autograd.grad(want, reference_inputs, grad)
        for name, a, b in zip(["q", "k", "v", "sinks"], got, wanted):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)


def test_sink_correction_of_the_log_sum_exp_equals_the_softmax_with_sinks():
    """The CUDA path's math on its own, in float64 with gradients: attention without sinks and its log-sum-exp,
    rescaled by ``sigmoid(lse - sink)``, is attention whose softmax also counts the sink (what FlexAttention's
    ``return_aux`` lse feeds on a GPU, where this has never run)."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64) * 3
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    value = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64)
    sinks = torch.tensor([-2.0, 0.5, 4.0], dtype=torch.float64, requires_grad=True)
    lse = torch.logsumexp(scores, dim=-1)
    got = kernels.sink_correction(torch.softmax(scores, dim=-1) @ value, lse, sinks)
    with_sink = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(2, 3, 7, 1)], dim=-1)
    want = torch.softmax(with_sink, dim=-1)[..., :-1] @ value
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad(got, sinks, grad)[0], torch.autograd.grad(want, sinks, grad)[0], atol=1e-12, rtol=1e-12
    )
