"""The varlen attention kernel's logic on CPU: the documents' cumulative lengths, the packed layout, and the whole
path with torch's CUDA op replaced by a float32 CPU stand-in of the same signature (per-document causal SDPA),
against the dense-mask SDPA path, forward and backward; its setting's checks. The CUDA op itself is checked on a
GPU by bench/attention_kernels.py (docs/attention.md)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ATTENTION_KERNELS, Config, validate_config
from meshtron.distributed.context_parallel.routing import hf_attention
from meshtron.errors import ConfigError
from meshtron.models import attention_kernels as kernels
from meshtron.models import varlen as torch_varlen
from meshtron.models.attention import document_ids
from meshtron.train.batch import SequenceSplit, host_document_bounds, sequence_inputs

EOS = 0


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def _per_document(query, key, value, cu_seq_q, cu_seq_k, scale, causal, gqa, calls):
    """Causal SDPA in float32 on each sequence of ``cu_seq_q`` (what flash's varlen kernel computes)."""
    assert causal, "meshtron calls the varlen kernel causally"
    assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32
    assert gqa or key.shape[1] == query.shape[1], "without enable_gqa the kv heads must be expanded"
    calls.append(cu_seq_q.tolist())
    bounds = cu_seq_q.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1).float() for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        pieces.append(out.transpose(0, 1).to(query.dtype))
    return torch.cat(pieces)


def stand_in(version: str, calls: list):
    """A CPU function with the signature of torch's ``varlen_attn`` in ``version``: 2.12+ (``window_size``,
    ``scale``, ``enable_gqa``), 2.11 (``window_size``, ``scale``), 2.10 (``is_causal``, no scale)."""
    if version == "2.12":

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
        ):  # fmt: skip
            causal = tuple(window_size) == (-1, 0)
            return _per_document(query, key, value, cu_seq_q, cu_seq_k, scale, causal, enable_gqa, calls)

    elif version == "2.11":

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            causal = tuple(window_size) == (-1, 0)
            return _per_document(query, key, value, cu_seq_q, cu_seq_k, scale, causal, False, calls)

    else:

        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            scale = query.shape[-1] ** -0.5  # the kernel's own
            return _per_document(query, key, value, cu_seq_q, cu_seq_k, scale, is_causal, False, calls)

    return varlen_attn


@pytest.fixture
def varlen(monkeypatch):
    """Put a stand-in for torch's varlen op in place; returns the list of the calls' cumulative lengths."""

    def install(version="2.12", dtypes=kernels.VARLEN_DTYPES):
        calls = []
        monkeypatch.setattr(torch_varlen, "VARLEN", torch_varlen.VarlenOp.of(stand_in(version, calls)))
        monkeypatch.setattr(kernels, "VARLEN_DTYPES", dtypes)
        return calls

    return install


def packed_tokens() -> torch.Tensor:
    """Row 0: several documents (one of a single token), the last cut by the row's end; row 1: one document
    (id 0, as the first of row 2: a row's start starts a document whatever its id); row 2: three documents."""
    tokens = torch.randint(1, 50, (3, 40), generator=torch.Generator().manual_seed(0))
    tokens[0, [3, 4, 17, 30]] = EOS
    tokens[2, [9, 25]] = EOS
    return tokens


def brute_force_lengths(docs: torch.Tensor) -> list[int]:
    """Document starts walked token by token over the rows laid end to end."""
    rows, length = docs.shape
    starts = []
    for row in range(rows):
        for i in range(length):
            if i == 0 or docs[row, i] != docs[row, i - 1]:
                starts.append(row * length + i)
    return starts + [rows * length]


def test_document_lengths():
    docs = document_ids(packed_tokens(), EOS)
    lengths = kernels.document_lengths(docs)
    assert lengths.dtype == torch.int32
    # Row 0 (0..39): documents start at 0, 4, 5, 18, 31; row 1 (40..79) is one; row 2 (80..119): 0, 10, 26.
    assert lengths.tolist() == [0, 4, 5, 18, 31, 40, 80, 90, 106, 120]
    assert lengths.tolist() == brute_force_lengths(docs)
    one_each = torch.zeros(2, 5, dtype=torch.long)  # same id at the end of row 0 and the start of row 1
    assert kernels.document_lengths(one_each).tolist() == [0, 5, 10]
    assert kernels.document_lengths(None, "cpu", rows=3, length=7).tolist() == [0, 7, 14, 21]
    random_ids = torch.cumsum(torch.rand(4, 64, generator=torch.Generator().manual_seed(2)) < 0.1, dim=1)
    assert kernels.document_lengths(random_ids).tolist() == brute_force_lengths(random_ids)


def test_pack_and_unpack_rows():
    tensor = torch.randn(2, 3, 5, 4)
    packed = kernels.pack_rows(tensor)
    assert packed.shape == (10, 3, 4)
    for b in range(2):
        for i in range(5):
            assert torch.equal(packed[b * 5 + i], tensor[b, :, i])
    assert torch.equal(kernels.unpack_rows(packed, 2), tensor)
    # Memory already (B, L, H, D), as the projections make it: packing copies nothing.
    projected = torch.randn(2, 5, 3, 4).transpose(1, 2)
    assert kernels.pack_rows(projected).data_ptr() == projected.data_ptr()


def _qkv(dtype, heads=4, kv_heads=2, length=40, dim=16):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, length, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)]


def _forward_backward(kernel, inputs, docs, scale, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = kernels.document_attention(*leaves, docs, scale, kernel=kernel)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("version", ["2.12", "2.11", "2.10"])
@pytest.mark.parametrize("scale", [0.25, 0.3])
def test_varlen_path_matches_the_dense_mask_in_float32(varlen, version, scale):
    """Every torch signature, GQA (4 query / 2 kv heads), the kernel's own scale (1/sqrt(16)) and another one:
    output and q/k/v gradients equal the SDPA + dense mask path's."""
    calls = varlen(version, dtypes=(torch.float32,))
    docs = document_ids(packed_tokens(), EOS)
    inputs = _qkv(torch.float32)
    grad_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3))
    got = _forward_backward("varlen", inputs, docs, scale, grad_out)
    assert calls == [kernels.document_lengths(docs).tolist()]
    want = _forward_backward("sdpa", inputs, docs, scale, grad_out)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)


def test_varlen_path_in_bfloat16_against_float32(varlen):
    """bf16, the dtype the kernel runs in: within bf16 rounding of the float32 dense-mask result (a wrong mask
    or layout is off by far more)."""
    calls = varlen()
    docs = document_ids(packed_tokens(), EOS)
    inputs = _qkv(torch.bfloat16)
    grad_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = _forward_backward("varlen", inputs, docs, 0.25, grad_out)
    want = _forward_backward("sdpa", [t.float() for t in inputs], docs, 0.25, grad_out.float())
    assert len(calls) == 1
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        error = ((g.float() - w).norm() / w.norm()).item()
        assert error < 1e-2, (name, error)
    wrong = _forward_backward("sdpa", [t.float() for t in inputs], None, 0.25, grad_out.float())[0]
    assert ((wrong - want[0]).norm() / want[0].norm()).item() > 0.1  # the check can tell the masks apart


@pytest.mark.parametrize(
    "variant", [{"window": 8}, {"softcap": 2.0}, {"sinks": torch.zeros(4)}, {"dtype": torch.float32}]
)
def test_windows_soft_caps_sinks_and_fp32_keep_flex(varlen, variant):
    calls = varlen()
    variant = dict(variant)
    dtype = variant.pop("dtype", torch.bfloat16)
    docs = document_ids(packed_tokens(), EOS)
    q, k, v = _qkv(dtype)
    got = kernels.document_attention(q, k, v, docs, 0.25, kernel="varlen", **variant)
    want = kernels.document_attention(q, k, v, docs, 0.25, kernel="flex", **variant)
    assert calls == [] and torch.equal(got, want)


def test_lengths_built_once_per_micro_batch_from_the_host(varlen):
    """Training's route: the lengths from the host copy of the batch (``host_document_bounds``) go into the
    layout's cache with the flex masks for sliding windows; every layer reuses them; hf_attention equals the
    dense-mask path. Rows other than the host lengths' (a pipeline microbatch) get theirs computed instead."""
    calls = varlen()
    tokens = packed_tokens()
    split = SequenceSplit(mask_documents=True, eos_token_id=EOS, attention_kernel="varlen", attention_windows=(None, 8))
    host = host_document_bounds(tokens, split)
    assert host.tolist() == kernels.document_lengths(document_ids(tokens, EOS)).tolist()
    assert host_document_bounds(tokens, SequenceSplit(mask_documents=True, eos_token_id=EOS)) is None
    layout = sequence_inputs(tokens, split, host)["sequence_layout"]
    assert layout.document_kernel == "varlen"
    cache = layout.attention_cache
    assert cache[("varlen", "cpu", 40)].tolist() == host.tolist()
    assert ("flex", "cpu", 40, 8) in cache  # the windowed layers' mask
    q, k, v = _qkv(torch.bfloat16)
    for _ in range(2):  # two layers
        out, _ = hf_attention(None, q, k, v, None, scaling=0.25, sequence_layout=layout)
    assert len(calls) == 2 and calls[0] == calls[1] == host.tolist()
    want = kernels.document_attention(q, k, v, layout.document_ids, 0.25, kernel="sdpa").transpose(1, 2)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)

    rows = sequence_inputs(tokens[1:], split, host)["sequence_layout"]  # the host lengths cover 3 rows, not 2
    assert rows.attention_cache[("varlen", "cpu", 40)].tolist() == [0, 40, 50, 66, 80]


def test_model_forward_and_backward_match_sdpa(varlen):
    """A 2-layer model through sequence_inputs: the varlen path's logits and gradients equal the default's."""
    from test_attention_kernels import _tiny_model

    varlen(dtypes=(torch.float32,))
    tokens = packed_tokens()[:2]
    results = []
    for kernel in ("auto", "varlen"):
        model = _tiny_model()
        split = SequenceSplit(mask_documents=True, eos_token_id=EOS, attention_kernel=kernel)
        logits = model(**sequence_inputs(tokens, split, host_document_bounds(tokens, split))).logits
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (sdpa_logits, sdpa_grads), (varlen_logits, varlen_grads) = results
    torch.testing.assert_close(varlen_logits, sdpa_logits, atol=1e-5, rtol=1e-5)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(varlen_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _config(**model) -> Config:
    cfg = Config()
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def test_setting_is_checked():
    assert ATTENTION_KERNELS == kernels.KERNELS
    with pytest.raises(ConfigError, match="model.attention_kernel"):
        validate_config(_config(attention_kernel="flash"))
    for kernel in ATTENTION_KERNELS:
        validate_config(_config(attention_kernel=kernel))
    _check_kernel(_config(attention_kernel="varlen"), "cuda", "bf16")
    _check_kernel(_config(attention_kernel="auto"), "cpu", "none")
    _check_kernel(_config(attention_kernel="sdpa"), "cpu", "none")
    _check_kernel(_config(attention_kernel="varlen", dtype="bfloat16"), "cuda", "none")
    with pytest.raises(ConfigError, match="varlen runs on CUDA only"):
        _check_kernel(_config(attention_kernel="varlen"), "cpu", "none")
    with pytest.raises(ConfigError, match="bf16 / fp16 only"):
        _check_kernel(_config(attention_kernel="varlen"), "cuda", "none")
    cp = _config(attention_kernel="flex")
    cp.parallel.cp = 2
    with pytest.raises(ConfigError, match="parallel.cp=1 only"):
        _check_kernel(cp, "cuda", "bf16")
    plain = _config(attention_kernel="varlen")
    plain.data.mask_documents = False
    with pytest.raises(ConfigError, match="data.mask_documents"):
        _check_kernel(plain, "cuda", "bf16")


def test_torch_without_varlen_is_refused(monkeypatch):
    monkeypatch.setattr(torch_varlen, "VARLEN", None)
    with pytest.raises(ConfigError, match="needs torch.nn.attention.varlen"):
        _check_kernel(_config(attention_kernel="varlen"), "cuda", "bf16")
    assert torch_varlen.VarlenOp.of(None) is None
    assert torch_varlen.VarlenOp.of(lambda q, k, v, cu_q, cu_k, max_q, max_k: q) is None  # no causal argument


def test_installed_torch_signature_is_understood():
    """The torch here (2.13 when written) has window_size, scale and enable_gqa: all used, nothing emulated."""
    op = torch_varlen.VARLEN
    assert op is not None and op.causal == ("window_size", (-1, 0)) and op.takes_scale and op.takes_gqa


def _reference(query, key, value, cu_lengths, scale, gqa):
    return _per_document(query, key, value, cu_lengths, cu_lengths, scale, True, gqa, [])


@torch.library.custom_op("meshtron_test::varlen_forward", mutates_args=())
def _varlen_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    return _reference(query, key, value, cu, scale, gqa)


@_varlen_forward.register_fake
def _(query, key, value, cu, scale, gqa):
    return torch.empty_like(query)


@torch.library.custom_op("meshtron_test::varlen_backward", mutates_args=())
def _varlen_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's gradients by hand, document by document (autograd does not run inside an op)."""
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    groups = query.shape[1] // key.shape[1]
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v, g = (t[start:end].transpose(0, 1) for t in (query, key, value, grad))  # (H, n, D)
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        visible = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        p = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf")), dim=-1)
        dp = g @ v.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[start:end] = (ds @ k * scale).transpose(0, 1)
        dk[start:end] = (ds.transpose(1, 2) @ q * scale).unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
        dv[start:end] = (p.transpose(1, 2) @ g).unflatten(0, (-1, groups)).sum(1).transpose(0, 1)
    return dq, dk, dv


@_varlen_backward.register_fake
def _(grad, query, key, value, cu, scale, gqa):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.scale, ctx.gqa = inputs[4], inputs[5]


def _backward(ctx, grad):
    query, key, value, cu = ctx.saved_tensors
    return (*_varlen_backward(grad, query, key, value, cu, ctx.scale, ctx.gqa), None, None, None)


_varlen_forward.register_autograd(_backward, setup_context=_setup)


def custom_op_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False,
):  # fmt: skip
    """torch's varlen_attn as far as torch.compile sees it: a custom op with a fake and a backward op."""
    assert tuple(window_size) == (-1, 0) and cu_seq_q is cu_seq_k
    return _varlen_forward(query, key, value, cu_seq_q, scale, enable_gqa)


def test_compiled_varlen_path_traces_whole_and_does_not_recompile_per_document_count(monkeypatch):
    """As in training: the lengths prepared outside, attention inside torch.compile (fullgraph: no graph break),
    forward and backward equal the eager path's, and a micro-batch with another count of documents reuses the
    compiled graph (the lengths' size is dynamic)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(torch_varlen, "VARLEN", torch_varlen.VarlenOp.of(custom_op_varlen_attn))
    monkeypatch.setattr(kernels, "VARLEN_DTYPES", (torch.float32,))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, cache: kernels.document_attention(q, k, v, None, 0.3, kernel="varlen", cache=cache),
        backend=counter,
        fullgraph=True,
    )
    inputs = _qkv(torch.float32)
    grad_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3))
    tokens = packed_tokens()
    for cut in ([], [12, 20], [33]):  # 9, 11 and 10 documents
        tokens = tokens.clone()
        tokens[1, cut] = EOS
        docs = document_ids(tokens, EOS)
        cache = {}
        kernels.prepare_masks(cache, None, "cpu", 40, kernel="varlen", lengths=kernels.document_lengths(docs))
        got = _forward_backward_with(lambda *t, c=cache: compiled(*t, c), inputs, grad_out)
        want = _forward_backward("sdpa", inputs, docs, 0.3, grad_out)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
    assert counter.frame_count == 1


def _forward_backward_with(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def test_train_on_cpu_refuses_varlen_in_one_line(capsys):
    from meshtron.cli import main

    fast = ["--model.preset=tiny", "--data.max_documents=5", "--data.seq_len=16", "--train.steps=1"]
    code = main(["train", *fast, "--run.progress=false", "--model.attention_kernel=varlen"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("meshtron: error")]
    assert code != 0 and len(lines) == 1
    assert "model.attention_kernel=varlen runs on CUDA only" in lines[0], lines[0]


def _check_kernel(cfg, device_type, precision):
    """``check_attention_kernel`` on ``cfg``'s settings, as preflight calls it."""
    kernels.check_attention_kernel(cfg.model, cfg.parallel.cp, cfg.data.mask_documents, device_type, precision)
