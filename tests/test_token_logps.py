"""Each label's log-probability under the head (meshtron.train.loss.token_logps) against PyTorch's log-softmax.

Under tensor parallelism (a vocabulary-sharded head on 2 gloo ranks) it is checked in tests/data_parallel_worker.py's
launch (test_data_parallel.py::test_two_ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.data.labels import IGNORE_INDEX
from meshtron.train.loss.token_logps import head_token_logps


def reference_token_logps(hidden, labels, weight, bias=None, softcap=None, compute_dtype=None):
    """``F.log_softmax(F.linear(...).float())`` at the labels, 0 where ignored: what head_token_logps computes."""
    w = weight.to(compute_dtype) if compute_dtype else weight
    b = bias.to(compute_dtype) if (bias is not None and compute_dtype) else bias
    h = hidden.to(compute_dtype) if compute_dtype else hidden
    logits = F.linear(h.flatten(0, 1), w, b).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    labels = labels.flatten()
    valid = labels != IGNORE_INDEX
    logps = F.log_softmax(logits, dim=-1).gather(1, torch.where(valid, labels, 0).unsqueeze(1)).squeeze(1)
    return logps * valid


def _inputs(dtype=torch.float32, vocab=37, hidden_size=16, batch=3, seq=11, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :4] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    upstream = torch.randn(batch * seq, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return hidden, labels, weight, b, upstream


def _grads(logps, upstream, *tensors):
    """Gradients of ``sum(upstream * logps)``: every token's gradient is a different one."""
    return torch.autograd.grad((logps * upstream).sum(), [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [0, 1, 5, 16, 4096])
@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, False), (None, True)])
def test_token_logps_and_gradients_equal_log_softmax_in_float64(chunk, softcap, bias):
    hidden, labels, weight, b, upstream = _inputs(torch.float64, bias=bias)
    got = head_token_logps(hidden, labels, weight, b, chunk_size=chunk, softcap=softcap)
    want = reference_token_logps(hidden, labels, weight, b, softcap).to(got.dtype)
    assert got.dtype == torch.float32 and got.shape == (labels.numel(),)
    assert torch.all(got[labels.flatten() == IGNORE_INDEX] == 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # float32 output, float64 reference: compare the gradients through the same float32 rounding of logps
    want64 = reference_token_logps(hidden, labels, weight, b, softcap)
    for g, w in zip(_grads(got, upstream.float(), hidden, weight, b), _grads(want64, upstream, hidden, weight, b)):
        assert g.dtype == w.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 7])
def test_token_logps_equal_log_softmax_in_float32(chunk):
    hidden, labels, weight, b, upstream = _inputs(bias=True)
    got = head_token_logps(hidden, labels, weight, b, chunk_size=chunk, softcap=5.0)
    want = reference_token_logps(hidden, labels, weight, b, 5.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(_grads(got, upstream, hidden, weight, b), _grads(want, upstream, hidden, weight, b)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_bf16_compute_dtype_is_close_and_gives_master_dtype_gradients():
    hidden, labels, weight, _, upstream = _inputs(vocab=64)
    got = head_token_logps(hidden, labels, weight, chunk_size=8, compute_dtype=torch.bfloat16)
    want = reference_token_logps(hidden, labels, weight, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    grad_hidden, grad_weight = _grads(got, upstream, hidden, weight)
    assert grad_hidden.dtype == grad_weight.dtype == torch.float32
    want_hidden, want_weight = _grads(reference_token_logps(hidden, labels, weight), upstream, hidden, weight)
    torch.testing.assert_close(grad_weight, want_weight, rtol=0.05, atol=0.02)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=0.05, atol=0.02)


def test_without_autograd_only_the_forward_runs():
    hidden, labels, weight, _, _ = _inputs()
    with torch.no_grad():
        got = head_token_logps(hidden, labels, weight, chunk_size=4)
    assert not got.requires_grad
    torch.testing.assert_close(got, reference_token_logps(hidden, labels, weight).detach(), rtol=1e-5, atol=1e-6)


def test_a_second_backward_call_gives_the_same_gradients():
    """Zero-bubble pipeline schedules call backward twice (input gradients, then weight gradients)."""
    hidden, labels, weight, _, upstream = _inputs()
    logps = head_token_logps(hidden, labels, weight, chunk_size=5)
    loss = (logps * upstream).sum()
    (grad_hidden,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    (grad_weight,) = torch.autograd.grad(loss, [weight])
    want_hidden, want_weight = _grads(reference_token_logps(hidden, labels, weight), upstream, hidden, weight)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_weight, want_weight, rtol=1e-5, atol=1e-6)


def test_ignored_labels_get_no_gradient():
    hidden, labels, weight, _, upstream = _inputs()
    labels[1] = IGNORE_INDEX
    logps = head_token_logps(hidden, labels, weight, chunk_size=4)
    (grad_hidden,) = torch.autograd.grad((logps * upstream).sum(), [hidden])
    assert torch.all(grad_hidden[1] == 0) and grad_hidden[0].abs().sum() > 0


def test_compiled_chunks_match_eager():
    hidden, labels, weight, _, upstream = _inputs(vocab=64)
    eager = head_token_logps(hidden, labels, weight, chunk_size=8, softcap=5.0)
    compiled = head_token_logps(hidden, labels, weight, chunk_size=8, softcap=5.0, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(compiled, upstream, hidden, weight), _grads(eager, upstream, hidden, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
