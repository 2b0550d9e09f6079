"""Mixed-precision gradients without extra passes over the parameters (meshtron.distributed.precision's cast, the
fused loss's head gradient): the same gradients as the path before, and no float32 addition over a parameter in a
step of one micro-batch. In process, tiny models, fp32 master weights."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import meshtron.distributed.precision as precision
import meshtron.train.loss.fused as fused_loss
from meshtron.config import load_config
from meshtron.data.tokenizer import load_tokenizer
from meshtron.distributed.parallelize import parallelize_model
from meshtron.models.build import build_meta_model, load_hf_config, materialize
from meshtron.train.batch import SequenceSplit
from meshtron.train.setup.preflight import preflight
from meshtron.train.setup.run_setup import parallelize_options
from meshtron.train.step import StepContext, _forward_backward, step_options

TOKENS = 2 * 32  # per micro-batch: two sequences of 32


def _setup(preset: str, mixed_precision: str, chunk: int, compile_setting: str = "false"):
    cfg = load_config(
        None,
        [
            f"model.preset={preset}",
            f"precision.mixed_precision={mixed_precision}",
            f"train.compile={compile_setting}",
            f"train.loss_chunk_size={chunk}",
            "data.mask_documents=false",
        ],
        env={},
    )
    tokenizer = load_tokenizer("byte")
    model, adapter = build_meta_model(load_hf_config(cfg.model, tokenizer.vocab_size), cfg.model)
    adapter.return_hidden_states(model)
    setup = preflight(cfg, 1, "cpu")
    parallelize_model(model, adapter, setup.dims, None, parallelize_options(cfg, setup), "cpu")
    materialize(model, adapter, torch.device("cpu"), seed=0)
    ctx = StepContext(
        dp_rank=0,
        setup=setup,
        split=SequenceSplit(mask_documents=False, eos_token_id=tokenizer.eos_token_id),
        device=torch.device("cpu"),
        options=step_options(cfg),
        adapter=adapter,
    )
    return model, ctx


def _batches(count: int):
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 250, (2, TOKENS // 2), generator=generator) for _ in range(count)]
    return [(x, x, None) for x in ids]


def _gradients(model, ctx, batches) -> dict[str, torch.Tensor]:
    for param in model.parameters():
        param.grad = None
    _forward_backward(model, batches, ctx, 1.0 / TOKENS)
    return {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.fixture
def previous_path(monkeypatch):
    """Switches to the path before (ToCopyBackward casts; the head cast again inside the loss with its float32
    gradient added to the embedding's; a zero-filled weight-gradient buffer; multiply, then round)."""

    def use():
        monkeypatch.setattr(precision._ComputeCast, "apply", lambda param, dtype: param.to(dtype))
        monkeypatch.setattr(precision, "compute_weight", lambda model, weight: weight)  # compute_head's
        monkeypatch.setattr(
            fused_loss,
            "_add_float32",
            lambda total, part: (torch.zeros(part.shape) if total is None else total).add_(part),
        )
        monkeypatch.setattr(fused_loss, "_scaled", lambda grad, scale, dtype: (grad * scale).to(dtype))

    return use


@pytest.mark.parametrize(
    "preset, mixed_precision, chunk",
    [
        ("llama-tiny", "bf16", 24),  # untied, three loss chunks (the last shorter)
        ("qwen3-tiny", "bf16", 24),  # tied embeddings
        ("qwen3-tiny", "bf16", 0),  # tied, the unchunked loss
        ("qwen3-tiny", "none", 24),  # float32: untouched
    ],
)
def test_gradients_equal_the_previous_path_for_one_and_three_micro_batches(
    preset, mixed_precision, chunk, previous_path
):
    """One micro-batch and three: every gradient equals the previous path's bit for bit, except a tied bf16 weight's,
    whose embedding and head gradients (each in bf16) are now summed in bf16, as FSDP sums them, where the previous
    path added their float32 conversions: per micro-batch it is exactly that float32 sum rounded to bf16, and the
    micro-batches' gradients still add up in float32."""
    model, ctx = _setup(preset, mixed_precision, chunk)
    tied = {name for name, _ in model.named_parameters()} if model.config.tie_word_embeddings else set()
    tied = {name for name in tied if "embed_tokens" in name} if mixed_precision == "bf16" else set()
    batches = _batches(3)
    new_one = _gradients(model, ctx, batches[:1])
    new_three = _gradients(model, ctx, batches)
    previous_path()
    per_micro_batch = [_gradients(model, ctx, [batch]) for batch in batches]
    old_three = _gradients(model, ctx, batches)
    for name, old in per_micro_batch[0].items():
        want = old.bfloat16().float() if name in tied else old
        assert torch.equal(new_one[name], want), name
    for name in old_three:
        if name not in tied:
            assert torch.equal(new_three[name], old_three[name]), name
            continue
        total = per_micro_batch[0][name].bfloat16().float()
        for grads in per_micro_batch[1:]:
            total = total + grads[name].bfloat16().float()
        assert torch.equal(new_three[name], total), name
        assert not torch.equal(new_three[name], old_three[name])  # the bf16 sum is a real difference
    assert tied or mixed_precision == "none" or preset == "llama-tiny"


_COUNTED = ("aten::add", "aten::add_", "aten::_to_copy", "aten::copy_", "aten::zeros", "aten::zero_", "aten::fill_")
_DTYPES = {"float": "float32", "c10::BFloat16": "bfloat16"}


def _parameter_ops(model, run) -> Counter:
    """The add / copy / cast / fill operators over a parameter-sized tensor that ``run`` calls, by (name, tensor input
    dtypes), from torch.profiler (which sees the eager operators around compiled code too); an operator inside
    another counted one (a cast's copy, CPU's float32 temporary inside a mixed-dtype add) is part of that one."""
    shapes = [list(p.shape) for p in model.parameters() if p.dim() == 2]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        run()
    events = [
        event
        for event in profile.profiler.kineto_results.events()
        if event.name() in _COUNTED and event.shapes() and list(event.shapes()[0]) in shapes
    ]
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.start_thread_id()) for e in events]
    counts = Counter()
    for event, (start, end, thread) in zip(events, spans):
        if any(s <= start and end <= e and t == thread and (s, e) != (start, end) for s, e, t in spans):
            continue
        dtypes = tuple(_DTYPES[t] for t in event.dtypes() if t in _DTYPES)
        counts[(event.name().removeprefix("aten::"), dtypes)] += 1
    return counts


@pytest.mark.parametrize("compile_setting", ["false", "true"])
def test_a_step_of_one_micro_batch_adds_nothing_over_a_parameter(compile_setting, monkeypatch):
    """bf16 compute, fp32 master weights, tied embeddings, the fused loss in one chunk: a step of one micro-batch
    converts each parameter's gradient to float32 once (by ``torch._foreach_copy_``) and adds nothing over any
    parameter (the previous path:
    a zero-filled head buffer, its addition, and the tied weight's two float32 gradients added); a step of three
    adds each later micro-batch's bf16 gradient into the float32 one, one mixed-dtype addition per parameter and
    micro-batch, with no float32 conversion of its own. Compiled blocks (train.compile=true) change nothing here:
    the casts and their backward run outside the compiled code."""
    torch._dynamo.reset()
    monkeypatch.setattr(precision, "WIDEN_MIN_NUMEL", 0)  # the tiny model's matrices widened as a big model's are
    model, ctx = _setup("qwen3-tiny", "bf16", TOKENS, compile_setting)
    matrices = sum(p.dim() == 2 for p in model.parameters())
    batches = _batches(3)

    def step(count: int) -> Counter:
        for param in model.parameters():
            param.grad = None
        return _parameter_ops(model, lambda: _forward_backward(model, batches[:count], ctx, 1.0 / TOKENS))

    step(1)  # compiles, if it does
    # One micro-batch: a float32 conversion of each parameter's gradient (AccumulateGrad takes it: no add) and one of
    # the fused loss's head gradient (its chunk's product: no zero-filled buffer, no add); no float32 addition or fill
    # (the tied weight's two bf16 gradients are summed in bf16, as under FSDP).
    one = step(1)
    assert [key for key in one if "float32" in key[1] and key[0] in ("add", "add_", "zeros", "zero_", "fill_")] == []
    # Each parameter's conversion is written by _foreach_copy_ (its CUDA kernel reads and writes vectors; counted
    # here by the copy it makes on CPU), the loss's head gradient by a cast.
    assert one[("copy_", ("float32", "bfloat16"))] == matrices, one
    assert one[("_to_copy", ("bfloat16",))] == 1, one
    assert one[("_to_copy", ("float32",))] == matrices, one  # the forward's casts
    # Three: each later micro-batch's bf16 gradient added into the float32 one (one mixed-dtype add, no conversion).
    three = step(3)
    assert three[("add_", ("float32", "bfloat16"))] == 2 * matrices, three
    assert three[("copy_", ("float32", "bfloat16"))] == matrices, three
    assert three[("_to_copy", ("bfloat16",))] == 3, three
    assert [key for key in three if key[0].startswith("add") and key[1] == ("float32", "float32")] == [], three


def test_widened_gives_the_cast_values_bit_for_bit(monkeypatch):
    """``precision.widened`` (the master gradient written by ``torch._foreach_copy_``) equals ``.to(float32)`` for
    every bf16 / fp16 value, infinities and NaN included; a non-contiguous gradient or a same-dtype one takes ``.to``
    and keeps its strides."""
    from meshtron.distributed.precision import widened

    monkeypatch.setattr(precision, "WIDEN_MIN_NUMEL", 0)
    for dtype in (torch.bfloat16, torch.float16):
        every_value = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
        got = widened(every_value, torch.float32)
        assert got.dtype == torch.float32 and got.shape == every_value.shape
        assert torch.equal(got.view(torch.int32), every_value.to(torch.float32).view(torch.int32)), dtype
        transposed = every_value.t()
        assert torch.equal(widened(transposed, torch.float32).view(torch.int32), transposed.float().view(torch.int32))
    same = torch.randn(3, 4)
    assert widened(same, torch.float32) is same


def test_widened_leaves_small_and_differentiable_gradients_to_the_cast(monkeypatch):
    """Below ``WIDEN_MIN_NUMEL`` elements a gradient takes ``.to`` (``_foreach_copy_``'s kernel would leave SMs idle);
    under double backward (``create_graph=True``) too, since ``_foreach_copy_`` has no derivative: the second backward
    through a compute cast works."""
    from meshtron.distributed import precision

    small = torch.randn(4, 4, dtype=torch.bfloat16)
    assert precision.widened(small, torch.float32).grad_fn is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        precision.widened(small, torch.float32)
    assert "aten::_foreach_copy_" not in {event.name for event in profile.events()}

    monkeypatch.setattr(precision, "WIDEN_MIN_NUMEL", 0)
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    out = (x @ precision._ComputeCast.apply(weight, torch.bfloat16).t()).float().pow(2).sum()
    (grad,) = torch.autograd.grad(out, weight, create_graph=True)
    grad.sum().backward()  # raised "derivative for _foreach_copy_ is not implemented" before
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
