"""The fused chunked head + cross-entropy (meshtron.train.loss.fused) against PyTorch's own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.train.loss.head import IGNORE_INDEX, head_loss_sum


def _reference(hidden, labels, weight, bias=None, softcap=None, compute_dtype=None):
    w = weight.to(compute_dtype) if compute_dtype else weight
    b = bias.to(compute_dtype) if (bias is not None and compute_dtype) else bias
    logits = F.linear(hidden.flatten(0, 1), w, b).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _inputs(dtype=torch.float32, vocab=37, hidden_size=16, batch=3, seq=11, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :4] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    return hidden, labels, weight, b


def _grads(loss, *tensors):
    return torch.autograd.grad(loss * 0.37, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 5, 16, 33, 4096])
@pytest.mark.parametrize("softcap,bias", [(None, False), (3.0, False), (None, True)])
def test_fused_loss_equals_cross_entropy_fp32(chunk, softcap, bias):
    hidden, labels, weight, b = _inputs(bias=bias)
    expected = _reference(hidden, labels, weight, b, softcap)
    fused = head_loss_sum(hidden, labels, weight, b, chunk_size=chunk, softcap=softcap)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-5)
    for got, want in zip(_grads(fused, hidden, weight, b), _grads(expected, hidden, weight, b)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_loss_bf16_compute_gives_master_dtype_gradients():
    hidden, labels, weight, _ = _inputs(dtype=torch.bfloat16, vocab=301, hidden_size=32)
    expected = _reference(hidden, labels, weight, compute_dtype=torch.bfloat16)
    fused = head_loss_sum(hidden, labels, weight, chunk_size=7, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(fused, expected, rtol=2e-3, atol=2e-2)
    got_h, got_w = _grads(fused, hidden, weight)
    want_h, want_w = _grads(expected, hidden, weight)
    assert got_h.dtype == torch.bfloat16 and got_w.dtype == torch.float32  # straight to the fp32 master weight
    torch.testing.assert_close(got_h.float(), want_h.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=2e-3)


def test_fused_loss_without_autograd_computes_the_loss_only():
    hidden, labels, weight, _ = _inputs()
    with torch.no_grad():
        got = head_loss_sum(hidden, labels, weight, chunk_size=4)
    torch.testing.assert_close(got, _reference(hidden, labels, weight).detach(), rtol=1e-6, atol=1e-5)


def test_fused_loss_adds_up_over_micro_batches():
    """Gradient accumulation: two backward calls add into the same leaves as one loss over both."""
    hidden, labels, weight, _ = _inputs()
    for half in (slice(0, 2), slice(2, 3)):
        (head_loss_sum(hidden[half], labels[half], weight, chunk_size=6) * 0.5).backward()
    want = torch.autograd.grad(_reference(hidden, labels, weight) * 0.5, [hidden, weight])
    torch.testing.assert_close(hidden.grad, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, want[1], rtol=1e-5, atol=1e-6)


def test_compiled_fused_loss_matches_eager():
    hidden, labels, weight, _ = _inputs(vocab=64, hidden_size=16)
    eager = head_loss_sum(hidden, labels, weight, chunk_size=8, softcap=5.0)
    compiled = head_loss_sum(hidden, labels, weight, chunk_size=8, softcap=5.0, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(compiled, hidden, weight), _grads(eager, hidden, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
