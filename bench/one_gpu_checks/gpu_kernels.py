"""Kernel-level one-GPU checks: each computes on the GPU what training computes and compares it with a float64
reference on the CPU (``gpu_queue.py`` runs them, each in its own process)."""

from __future__ import annotations

import statistics

from gpu_support import Skip, cuda_device, relative_error


def _document_tokens(torch, generator, batch: int, length: int, documents: int):
    """Token rows with ``documents - 1`` EOS (0) at random places per row."""
    tokens = torch.randint(1, 50, (batch, length), generator=generator)
    for row in range(batch):
        tokens[row, torch.randperm(length - 1, generator=generator)[: documents - 1]] = 0
    return tokens


def _timed_ms(torch, run, iters: int = 10, warmup: int = 2, kernels_only: bool = False) -> float:
    """Median milliseconds of ``run()`` by CUDA events, after ``warmup`` calls. ``kernels_only``: the host runs ahead
    (``torch.cuda._sleep`` holds the GPU while the launches queue), so that launch overhead is not timed."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if kernels_only:
            torch.cuda._sleep(50_000_000)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


def varlen_attention(out) -> dict:
    """``model.attention_kernel=varlen`` (torch's flash varlen kernel over the documents) against float64 SDPA with
    the dense document mask, output and q/k/v gradients, next to bf16 SDPA's own error; fwd+bwd time of both."""
    import torch

    from meshtron.models import attention_kernels as kernels
    from meshtron.models.attention import document_ids

    device = cuda_device()
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 16, 4, 2048, 64
    docs = document_ids(_document_tokens(torch, generator, batch, length, 7), 0)
    leaves = [torch.randn(batch, h, length, dim, generator=generator, dtype=torch.float64) for h in (heads, kv_heads)]
    leaves.append(torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64))
    weight = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
    scale = dim**-0.5

    def run(kernel, dtype, where):
        # detached first: on the CPU in float64 .to() returns the leaf itself, which would then require grad and
        # make the GPU runs' inputs non-leaf copies of it, with no .grad
        inputs = [t.detach().to(where, dtype).requires_grad_() for t in leaves]
        result = kernels.document_attention(*inputs, docs.to(where), scale, kernel=kernel)
        (result * weight.to(where, dtype)).sum().backward()
        return [result] + [t.grad for t in inputs]

    want = run("sdpa", torch.float64, "cpu")
    figures = {}
    for kernel in ("varlen", "sdpa"):
        got = run(kernel, torch.bfloat16, device)
        figures[f"{kernel}_bf16_error"] = max(relative_error(g, w) for g, w in zip(got, want))
    bound = max(2 * figures["sdpa_bf16_error"], 2e-2)
    assert figures["varlen_bf16_error"] <= bound, f"varlen error {figures['varlen_bf16_error']:.2e} > {bound:.2e}"
    for kernel in ("varlen", "sdpa"):
        figures[f"{kernel}_fwd_bwd_ms"] = _timed_ms(torch, lambda kernel=kernel: run(kernel, torch.bfloat16, device))
    return figures


def _causal_reference(torch, q, k, v, weight, scale):
    """float64 causal grouped-query attention over the whole sequence: output and q/k/v gradients."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(groups, 1) for t in leaves[1:])
    visible = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    scores = (leaves[0] @ keys.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    result = torch.softmax(scores, -1) @ values
    (result * weight).sum().backward()
    return [result.detach()] + [t.grad for t in leaves]


def cp_ring_tiles(out) -> dict:
    """Context-parallel attention's per-tile kernels as the ring runs them (meshtron.distributed.context_parallel:
    ``tile_forward`` per (query chunk, key chunk), merged by log-sum-exp, ``tile_backward`` with the final output)
    on the device against float64 causal attention: output and q/k/v gradients. On CUDA these are the flash /
    memory-efficient ops that the CPU suite replaces with the CPU flash op; on CPU the check runs small."""
    import torch

    from meshtron.distributed.context_parallel.fused_tile_kernels import fold_kv
    from meshtron.distributed.context_parallel.tile_kernels import (
        choose_tile_kernel,
        merge_partial,
        tile_backward,
        tile_forward,
    )

    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    chunks, batch, heads, kv_heads, dim = 4, 2, 8, 2, 64
    chunk = 512 if cuda else 32
    generator = torch.Generator().manual_seed(0)
    q, weight = (torch.randn(batch, heads, chunks * chunk, dim, generator=generator, dtype=torch.float64) for _ in "qw")
    k, v = (torch.randn(batch, kv_heads, chunks * chunk, dim, generator=generator, dtype=torch.float64) for _ in "kv")
    scale = dim**-0.5
    want = _causal_reference(torch, q, k, v, weight, scale)

    def part(t, i):
        return t[:, :, i * chunk : (i + 1) * chunk].to(device, dtype).contiguous()

    outs, lses = [], []
    for i in range(chunks):  # query chunk i sees key chunks 0..i: full tiles, then its causal diagonal
        acc = None
        for j in range(i + 1):
            tile = tile_forward(part(q, i), part(k, j), part(v, j), "causal" if j == i else None, scale)
            acc = tile if acc is None else merge_partial(*acc, *tile)
        outs.append(acc[0])
        lses.append(acc[1])
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v)]
    for i in range(chunks):
        for j in range(i + 1):
            dq, dk, dv = tile_backward(
                part(q, i), part(k, j), part(v, j), "causal" if j == i else None, scale, outs[i], lses[i],
                part(weight, i).float(),
            )  # fmt: skip
            if dk.shape[1] != kv_heads:
                dk, dv = fold_kv(dk, heads // kv_heads), fold_kv(dv, heads // kv_heads)
            grads[0][:, :, i * chunk : (i + 1) * chunk] += dq
            grads[1][:, :, j * chunk : (j + 1) * chunk] += dk
            grads[2][:, :, j * chunk : (j + 1) * chunk] += dv
    got = [torch.cat(outs, dim=2)] + grads
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    bound = 2e-2 if dtype == torch.bfloat16 else 1e-4
    worst = max(errors.values())
    kernel = choose_tile_kernel(device, dtype, dim, None)
    assert worst <= bound, f"{kernel} tiles vs float64: relative errors {errors} > {bound:.0e}"
    return {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), **errors}


def fused_loss(out) -> dict:
    """The fused chunked head + cross-entropy (``train.loss_chunk_size``) in bf16 compute against the float64
    loss and gradients of the unchunked head; on CUDA also its peak memory against the unfused loss's."""
    import torch
    import torch.nn.functional as F

    from meshtron.train.loss.fused import fused_head_loss_sum

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tokens, hidden, vocab = (8192, 2048, 32768) if cuda else (256, 64, 1024)
    generator = torch.Generator().manual_seed(0)
    h64 = torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    w64 = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) * hidden**-0.5
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::7] = -100
    ref = [t.clone().requires_grad_() for t in (h64, w64)]
    want_loss = F.cross_entropy(ref[0] @ ref[1].T, labels, ignore_index=-100, reduction="sum")
    want_loss.backward()

    def fused(chunk_size):
        leaves = [t.to(device, torch.float32).requires_grad_() for t in (h64, w64)]
        loss = fused_head_loss_sum(
            leaves[0], labels.to(device), leaves[1], None, chunk_size=chunk_size, compute_dtype=torch.bfloat16
        )
        loss.backward()
        return loss, leaves

    if cuda:  # the allocator's statistics exist once CUDA is initialized ("Invalid device argument" before)
        torch.empty(1, device=device)
        torch.cuda.reset_peak_memory_stats(device)
    loss, leaves = fused(tokens // 8)
    figures = {"loss_error": abs(float(loss) - float(want_loss)) / abs(float(want_loss))}
    figures["grad_hidden_error"] = relative_error(leaves[0].grad, ref[0].grad)
    figures["grad_weight_error"] = relative_error(leaves[1].grad, ref[1].grad)
    worst = max(figures.values())
    assert worst <= 2e-2, f"fused loss in bf16 vs float64: {figures}"
    if cuda:
        figures["fused_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        del loss, leaves
        torch.cuda.reset_peak_memory_stats(device)
        fused(0)  # one chunk: the whole logits at once
        figures["unchunked_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return figures


def gradient_widening(out) -> dict:
    """The master gradient's bf16 -> float32 conversion (``precision.widened``: ``torch._foreach_copy_`` from
    ``WIDEN_MIN_NUMEL`` elements, ``.to`` below) against ``.to(float32)`` (torch's unrolled copy: 4.1 ms a step for
    llama-1b on an H200) and an inductor kernel, per shape of llama-1b's gradients (16 of each block matrix, the
    embedding once): equal bits, the kernels' time of each (CUDA events, launches queued ahead). And the next change
    it points at, the fused loss's head gradient per 4,096-token chunk: a bf16 product added into the float32 sum
    (today, 4 chunks: 3.8 ms a step) against ``torch.addmm(..., out_dtype=torch.float32)``, which adds in the GEMM's
    epilogue (CUDA only). On a CPU (``GPU_QUEUE_ON_CPU``) it skips: the shapes are a GPU's."""
    import torch

    from meshtron.distributed import precision

    device = cuda_device()
    if device.type != "cuda":
        raise Skip("times CUDA kernels over a 1B model's gradients: a GPU's shapes")
    hidden, inter, vocab, kv = 2048, 8192, 128256, 512
    groups = {"embedding": [(vocab, hidden)], "mlp": 48 * [(inter, hidden)], "q_o": 32 * [(hidden, hidden)]}
    groups["k_v"] = 32 * [(kv, hidden)]
    compiled = torch.compile(lambda t: t.to(torch.float32), dynamic=True)

    def foreach(t):
        out = torch.empty_like(t, dtype=torch.float32)
        torch._foreach_copy_([out], [t])
        return out

    ways = {"to": lambda t: t.to(torch.float32), "foreach_copy": foreach, "inductor": compiled}
    ways["widened"] = lambda t: precision.widened(t, torch.float32)
    figures = {"widen_min_numel": precision.WIDEN_MIN_NUMEL}
    for group, shapes in groups.items():
        grads = [torch.randn(shape, device=device, dtype=torch.bfloat16) for shape in shapes]
        for name, convert in ways.items():
            assert torch.equal(convert(grads[0]).view(torch.int32), grads[0].float().view(torch.int32)), name
            figures[f"{group}_{name}_ms"] = _timed_ms(
                torch, lambda convert=convert, grads=grads: [convert(g) for g in grads], 5, 1, kernels_only=True
            )
        grads.clear()
    for name in ways:
        figures[f"all_{name}_ms"] = round(sum(figures[f"{group}_{name}_ms"] for group in groups), 3)
    chunk = torch.randn(4096, vocab, device=device, dtype=torch.bfloat16)
    h = torch.randn(4096, hidden, device=device, dtype=torch.bfloat16)
    total = torch.zeros(vocab, hidden, device=device)

    def add_after_product():
        total.add_(chunk.t() @ h)

    def add_in_epilogue():
        torch.addmm(total, chunk.t(), h, out_dtype=torch.float32, out=total)

    figures["head_chunk_add_after_ms"] = _timed_ms(torch, add_after_product, 5, 1, kernels_only=True)
    try:
        figures["head_chunk_addmm_out_dtype_ms"] = _timed_ms(torch, add_in_epilogue, 5, 1, kernels_only=True)
    except (RuntimeError, TypeError) as err:  # an older torch: no out_dtype
        figures["head_chunk_addmm_out_dtype"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return figures


def rope_scaling_long(out) -> dict:
    """A YaRN-extended llama (``model.rope_scaling``, 4x its positions) at 8,192 tokens: the GPU's fp32 logits
    against float64 on the CPU; then two training steps at 16,384 tokens on the GPU with finite losses."""
    import torch
    from gpu_support import exact_float32, settings_for, train_here
    from transformers import AutoModelForCausalLM

    from meshtron.config import ModelConfig
    from meshtron.models.context_extension import extend_context
    from meshtron.models.presets import make_preset_config

    device = cuda_device()
    exact_float32(torch)
    config = make_preset_config("llama-small", 257)
    config.num_hidden_layers = 2
    extend_context(config, ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    ids = torch.randint(0, 257, (1, 8192), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = model.float().to(device)(input_ids=ids.to(device)).logits
    error = relative_error(got, want)
    assert error <= 1e-4, f"fp32 logits on the GPU vs float64 at 8,192 positions: relative error {error:.2e}"
    del model
    settings = settings_for(
        out / "train",
        'model.rope_scaling={"rope_type": "yarn", "factor": 8.0}',
        "train.compile=false",
        preset="llama-small",
        seq_len=16384,
        batch=1,
        steps=2,
    )
    settings.append("data.max_documents=400")
    result = train_here(device, settings)
    assert all(map(torch.isfinite, map(torch.tensor, result.losses))), f"losses {result.losses}"
    return {"logits_error_8192": error, "losses_16384": [round(x, 4) for x in result.losses]}


def require(module: str) -> None:
    """``Skip`` when ``module`` cannot be imported here."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed")
