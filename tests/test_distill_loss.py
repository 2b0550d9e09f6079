"""The distillation loss on the head (meshtron.train.loss.distill) against a float64 implementation of TRL GKD's
definitions, TRL's own ``generalized_jsd_loss``, and its fused path against its unfused one."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_forked

from meshtron.train.loss.distill import DIVERGENCES, DistillOptions, distill_loss_sum
from meshtron.train.loss.head import IGNORE_INDEX

CASES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9)]


def _reference(student, teacher, labels, options: DistillOptions, softcap=None, teacher_softcap=None):
    """TRL GKD's generalized JSD (beta 0: forward KL, 1: reverse KL), summed over labelled tokens, plus alpha times
    the cross-entropy, in float64 from whole logits (B, S, V)."""
    student, teacher = student.double(), teacher.double()
    if softcap:
        student = torch.tanh(student / softcap) * softcap
    if teacher_softcap:
        teacher = torch.tanh(teacher / teacher_softcap) * teacher_softcap
    mask = labels != IGNORE_INDEX
    s, t = student[mask], teacher[mask]
    log_ps = F.log_softmax(s / options.temperature, -1)
    log_pt = F.log_softmax(t / options.temperature, -1)
    kl_t = lambda log_q: (log_pt.exp() * (log_pt - log_q)).sum()  # noqa: E731 KL(p_t || q)
    kl_s = lambda log_q: (log_ps.exp() * (log_ps - log_q)).sum()  # noqa: E731 KL(p_s || q)
    if options.divergence == "forward_kl":
        divergence = kl_t(log_ps)
    elif options.divergence == "reverse_kl":
        divergence = kl_s(log_pt)
    else:
        b = options.beta
        mixture = torch.logsumexp(torch.stack([log_ps + math.log(1 - b), log_pt + math.log(b)]), 0)
        divergence = b * kl_t(mixture) + (1 - b) * kl_s(mixture)
    ce = F.cross_entropy(s, labels[mask], reduction="sum")
    return options.alpha * ce + (1 - options.alpha) * divergence


def _logits(vocab=23, batch=2, seq=9, seed=0, scale=1.0):
    """Student and teacher logits (B, S, V) and labels with some IGNORE_INDEX."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(batch, seq, vocab, generator=gen) * scale
    teacher = torch.randn(batch, seq, vocab, generator=gen) * scale
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    return student, teacher, labels


def _on_logits(student, teacher, labels, options, chunk_size, **kwargs):
    """The loss, its sums and its gradient w.r.t. the student logits: an identity head (hidden = logits)."""
    vocab = student.shape[-1]
    hidden = student.clone().requires_grad_()
    eye = torch.eye(vocab)
    loss, sums = distill_loss_sum(
        hidden, teacher, labels, eye, None, eye, None, options, chunk_size=chunk_size, **kwargs
    )
    return loss, sums, torch.autograd.grad(loss, hidden)[0]


def _assert_close(got, want, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("divergence,beta", CASES)
@pytest.mark.parametrize("scale,atol", [(1.0, 1e-6), (3.0, 1e-5)])
def test_value_and_logits_gradient_equal_a_float64_reference(divergence, beta, scale, atol):
    """Logits of standard deviation 1 and 3 (at temperature 0.5, log-probabilities down to about -40, whose float32
    rounding, 4e-6 at 32, bounds the reverse KL's gradient error: plain float32 autograd's is the same)."""
    student, teacher, labels = _logits(scale=scale)
    for temperature in (0.5, 1.0, 2.0):
        for alpha in (0.0, 0.3):
            for softcap in (None, 4.0):
                options = DistillOptions(divergence, beta, temperature, alpha)
                caps = dict(softcap=softcap, teacher_softcap=softcap and 5.0)
                want_input = student.double().requires_grad_()
                want = _reference(want_input, teacher, labels, options, **caps)
                (want_grad,) = torch.autograd.grad(want, want_input)
                for chunk_size in (0, 5):
                    loss, sums, grad = _on_logits(student, teacher, labels, options, chunk_size, **caps)
                    case = (temperature, alpha, softcap, chunk_size)
                    assert loss.dtype == torch.float32 and sums.shape == (2,) and not sums.requires_grad, case
                    _assert_close(loss, want)
                    _assert_close(grad, want_grad, atol=atol)
                    _assert_close(alpha * sums[0] + (1 - alpha) * sums[1], loss)


def _head_inputs(bias: bool, seed=1, vocab=29, size=12, teacher_size=17):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, size, generator=gen) * 0.5).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.2).requires_grad_() if bias else None
    teacher_hidden = torch.randn(2, 7, teacher_size, generator=gen)
    teacher_weight = torch.randn(vocab, teacher_size, generator=gen) * 0.5
    teacher_bias = torch.randn(vocab, generator=gen) * 0.2 if bias else None
    labels = torch.randint(0, vocab, (2, 7), generator=gen)
    labels[1, :2] = IGNORE_INDEX
    return hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels


@pytest.mark.parametrize("divergence,beta", CASES[:2] + CASES[3:4])
@pytest.mark.parametrize("bias", [False, True])
def test_head_gradients_equal_float64_autograd(divergence, beta, bias):
    """A random head (the teacher's of another hidden size): hidden, weight and bias gradients."""
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = _head_inputs(bias)
    options = DistillOptions(divergence, beta, temperature=1.5, alpha=0.3)
    params = [t for t in (hidden, weight, b) if t is not None]
    wanted = [t.detach().double().requires_grad_() for t in params]
    student = F.linear(wanted[0], wanted[1], wanted[2] if bias else None)
    teacher_bias64 = teacher_bias.double() if bias else None
    teacher = F.linear(teacher_hidden.double(), teacher_weight.double(), teacher_bias64)
    want = _reference(student, teacher, labels, options, softcap=6.0, teacher_softcap=7.0)
    want_grads = torch.autograd.grad(want, wanted)
    for chunk_size in (0, 4):
        loss, _ = distill_loss_sum(
            hidden, teacher_hidden, labels, weight, b, teacher_weight, teacher_bias, options,
            chunk_size=chunk_size, softcap=6.0, teacher_softcap=7.0,
        )  # fmt: skip
        _assert_close(loss, want, atol=1e-6)
        for got, expected in zip(torch.autograd.grad(loss, params), want_grads):
            _assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _trl_generalized_jsd_loss():
    """TRL's ``GKDTrainer.generalized_jsd_loss``, its installed source run as is: importing trl.experimental.gkd
    costs ~10 s (trl, transformers' Trainer, torchao), the function itself needs only torch."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("trl is not installed")
    source = Path(spec.origin).parent / "experimental" / "gkd" / "gkd_trainer.py"
    if not source.exists():
        pytest.skip(f"{source} not found")
    tree = ast.parse(source.read_text())
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "GKDTrainer")
    function = next(node for node in trainer.body if getattr(node, "name", "") == "generalized_jsd_loss")
    function.decorator_list = []
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module([function], []), str(source), "exec"), namespace)
    return namespace["generalized_jsd_loss"]


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5)])
def test_equal_to_trl_generalized_jsd_loss(divergence, beta):
    trl_loss = _trl_generalized_jsd_loss()
    student, teacher, labels = _logits(seed=3)
    for temperature in (1.0, 2.0):
        want_input = student.double().requires_grad_()
        want = trl_loss(want_input, teacher.double(), labels, beta=beta, temperature=temperature, reduction="sum")
        (want_grad,) = torch.autograd.grad(want, want_input)
        options = DistillOptions(divergence, 0.5, temperature)
        for chunk_size in (0, 4):
            loss, _, grad = _on_logits(student, teacher, labels, options, chunk_size)
            _assert_close(loss, want)
            _assert_close(grad, want_grad, atol=1e-6)


def _both(options, *inputs, chunk_size, **kwargs):
    """(loss, sums, gradients of hidden, weight and bias if any) of one call."""
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = inputs
    loss, sums = distill_loss_sum(
        hidden,
        teacher_hidden,
        labels,
        weight,
        b,
        teacher_weight,
        teacher_bias,
        options,
        chunk_size=chunk_size,
        **kwargs,
    )
    params = [t for t in (hidden, weight, b) if t is not None]
    return loss, sums, torch.autograd.grad(loss * 0.37, params)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_fused_equals_unfused_for_every_chunk_size(divergence):
    inputs = _head_inputs(bias=True)
    options = DistillOptions(divergence, 0.3, temperature=0.7, alpha=0.2)
    want_loss, want_sums, want_grads = _both(options, *inputs, chunk_size=0, softcap=5.0)
    for chunk_size in (1, 3, 5, 14, 100):  # 14 tokens: 3 and 5 do not divide them
        loss, sums, grads = _both(options, *inputs, chunk_size=chunk_size, softcap=5.0)
        _assert_close(loss, want_loss, atol=1e-6)
        _assert_close(sums, want_sums, atol=1e-6)
        for got, want in zip(grads, want_grads):
            assert got.dtype == want.dtype
            _assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_compute_runs_close_to_float32():
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = _head_inputs(bias=False)
    options = DistillOptions("jsd", 0.5, temperature=2.0, alpha=0.3)
    inputs = (hidden.detach().bfloat16().requires_grad_(), weight, b, teacher_hidden.bfloat16(), teacher_weight)
    want_loss, _, want_grads = _both(options, *_head_inputs(bias=False), chunk_size=0)
    for chunk_size in (0, 4):
        loss, _, (grad_hidden, grad_weight) = _both(
            options, *inputs, teacher_bias, labels, chunk_size=chunk_size, compute_dtype=torch.bfloat16
        )
        assert (
            loss.dtype == torch.float32 and grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.float32
        )
        torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(grad_hidden.float(), want_grads[0], rtol=5e-2, atol=2e-2)
        torch.testing.assert_close(grad_weight, want_grads[1], rtol=5e-2, atol=2e-2)


def test_a_bf16_teacher_with_a_float32_student():
    """The teacher's head computes in its own dtype (no compute dtype given): the same as the float32 student's loss
    against that teacher's logits rounded to bfloat16."""
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = _head_inputs(bias=False)
    options = DistillOptions("forward_kl", temperature=1.0)
    low = (teacher_hidden.bfloat16(), teacher_weight.bfloat16())
    teacher_logits = F.linear(*low).float()
    student = F.linear(hidden, weight).detach().double().requires_grad_()
    want = _reference(student, teacher_logits, labels, options)
    (want_logits_grad,) = torch.autograd.grad(want * 0.37, student)
    for chunk_size in (0, 5):
        loss, _, (grad_hidden, _) = _both(options, hidden, weight, b, *low, None, labels, chunk_size=chunk_size)
        _assert_close(loss, want, atol=1e-6)
        _assert_close(grad_hidden, want_logits_grad @ weight.detach().double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [0, 4])
def test_without_autograd_only_the_forward_is_computed_and_equal(chunk_size):
    inputs = _head_inputs(bias=True)
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = inputs
    options = DistillOptions("reverse_kl", temperature=1.3, alpha=0.5)
    want_loss, want_sums, _ = _both(options, *inputs, chunk_size=chunk_size)
    with torch.no_grad():
        loss, sums = distill_loss_sum(
            hidden, teacher_hidden, labels, weight, b, teacher_weight, teacher_bias, options, chunk_size=chunk_size
        )
    assert loss.grad_fn is None
    assert torch.equal(loss, want_loss) and torch.equal(sums, want_sums)


def test_a_chunk_without_labels_and_no_labels_at_all():
    inputs = list(_head_inputs(bias=True))
    labels = inputs[-1].clone()
    labels[0] = IGNORE_INDEX  # the first 7 tokens: chunks of 4 and 3 without labels
    options = DistillOptions("jsd", 0.4, temperature=2.0, alpha=0.1)
    want_loss, want_sums, want_grads = _both(options, *inputs[:-1], labels, chunk_size=0)
    loss, sums, grads = _both(options, *inputs[:-1], labels, chunk_size=4)
    _assert_close(loss, want_loss, atol=1e-6)
    for got, want in zip(grads, want_grads):
        _assert_close(got, want, rtol=1e-5, atol=1e-7)
    nothing = torch.full_like(labels, IGNORE_INDEX)
    for chunk_size in (0, 4):
        loss, sums, grads = _both(options, *inputs[:-1], nothing, chunk_size=chunk_size)
        assert loss.item() == 0 and sums.tolist() == [0, 0]
        assert all(not grad.any() for grad in grads)


def test_backward_twice_gives_the_same_gradients():
    """Zero-bubble pipeline schedules call backward twice (input gradients, then weight gradients)."""
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = _head_inputs(bias=True)
    options = DistillOptions("reverse_kl", temperature=0.8, alpha=0.2)
    loss, _ = distill_loss_sum(
        hidden, teacher_hidden, labels, weight, b, teacher_weight, teacher_bias, options, chunk_size=4
    )
    first = torch.autograd.grad(loss * 3.0, (hidden, weight, b), retain_graph=True)
    second = torch.autograd.grad(loss * 3.0, (hidden, weight, b))
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_the_teacher_never_gets_gradients():
    hidden, weight, b, teacher_hidden, teacher_weight, teacher_bias, labels = _head_inputs(bias=True)
    teacher = [t.requires_grad_() for t in (teacher_hidden, teacher_weight, teacher_bias)]
    for chunk_size in (0, 4):
        loss, _ = distill_loss_sum(hidden, teacher[0], labels, weight, b, teacher[1], teacher[2],
                                   DistillOptions("jsd"), chunk_size=chunk_size)  # fmt: skip
        loss.backward()
        assert all(t.grad is None for t in teacher)


@pytest.mark.parametrize(
    "settings",
    [dict(divergence="kl"), dict(divergence="jsd", beta=0.0), dict(divergence="jsd", beta=1.0),
     dict(temperature=0.0), dict(alpha=1.5)],
)  # fmt: skip
def test_bad_options_are_refused(settings):
    with pytest.raises(ValueError):
        DistillOptions(**settings)


def test_tensor_parallel_equals_one_process(tmp_path):
    """On a 2-rank gloo mesh, both heads split over the vocabulary (``Shard(0)``), the student's hidden states
    sequence-parallel: fused and unfused loss, sums and gradients equal one process's (tests/distill_loss_worker.py)."""
    out = tmp_path / "distill.json"
    proc = run_forked(2, ["tests/distill_loss_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(f"{d}/{c}" for d in DIVERGENCES for c in (0, 3))
    for case, diffs in results.items():
        assert max(diffs.values()) < 1e-5, (case, diffs)
