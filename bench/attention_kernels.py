"""Document-masked attention kernels: FlexAttention + block mask and varlen flash vs SDPA + dense mask, exactness
and time.

On CUDA (default shape, llama-1b's attention: batch 4, 32 query / 8 key-value heads, 2048 tokens, head dim 64,
7 documents per row at random cuts (about 290 tokens each), bfloat16) it

1. checks meshtron's flex path (``document_attention(kernel="flex")``: compiled FlexAttention with the
   document ``BlockMask``) and its varlen path (``kernel="varlen"``: torch's flash varlen attention over the
   documents' cumulative lengths, **not yet run on a GPU**; plain causal document masks in bf16 / fp16 only)
   against SDPA with the dense (B, 1, S, S) mask: output and q/k/v gradients, each as relative error against a
   float32 SDPA reference, next to the error of bf16 SDPA itself;
2. times forward + backward (CUDA events, median) of SDPA causal without document mask, SDPA with the
   dense document mask, flex with the document block mask, flex causal, varlen with the document lengths and
   varlen with one document per row (= causal); masks and lengths are built once beforehand (as in training,
   where every layer reuses them), their build time is printed apart.

On CPU it runs a tiny shape in seconds: FlexAttention runs eagerly (its unfused reference) and forward
only, since it has no CPU backward, and the timings say nothing about a GPU.

Exit status 1 when a check fails. Example:

    python bench/attention_kernels.py
    python bench/attention_kernels.py --seq-len 8192 --batch 2 --documents 28   # seq 8192, ~290-token documents
    python bench/attention_kernels.py --seq-len 4096 --documents 14 --dtype float16
    python bench/attention_kernels.py --sinks     # gpt-oss's attention sinks (checked and timed with them)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

from meshtron.models import attention_kernels as kernels
from meshtron.models import varlen as torch_varlen
from meshtron.models.attention import document_ids

EOS = 0
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""Largest relative error (norm of the difference / norm of the reference) that passes."""


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4 if cuda else 2)
    p.add_argument("--heads", type=int, default=32 if cuda else 4)
    p.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    p.add_argument("--seq-len", type=int, default=2048 if cuda else 300)
    p.add_argument("--head-dim", type=int, default=64 if cuda else 16)
    p.add_argument("--documents", type=int, default=7 if cuda else 3, help="documents per row")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16" if cuda else "float32")
    p.add_argument("--iters", type=int, default=50 if cuda else 3)
    p.add_argument("--warmup", type=int, default=10 if cuda else 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--softcap", type=float, default=None, help="soft-cap the scores (Gemma 2: 50)")
    p.add_argument("--window", type=int, default=None, help="sliding window (Gemma, Mistral)")
    p.add_argument(
        "--value-head-dim", type=int, default=None, help="values narrower than q/k heads (DeepSeek-V3: 128 vs 192)"
    )
    p.add_argument("--sinks", action="store_true", help="check with attention sinks (gpt-oss), one logit per head")
    return p.parse_args(argv)


def packed_document_ids(batch: int, seq_len: int, documents: int, gen: torch.Generator) -> torch.Tensor:
    """(B, S) document ids of rows cut into ``documents`` documents at random EOS positions."""
    tokens = torch.ones(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=gen)[: documents - 1]
        tokens[row, cuts] = EOS
    tokens[:, -1] = EOS
    return document_ids(tokens, EOS)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def forward_backward(fn, inputs, grad_out):
    """Output and q/k/v gradients of ``fn`` at fresh leaf copies of ``inputs``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in leaves]


def varlen_runs(q, v, sinks=None, **variant) -> bool:
    """Whether ``kernel="varlen"`` runs the varlen kernel here (else it is FlexAttention: nothing of its own)."""
    cuda = q.device.type == "cuda" and torch_varlen.VARLEN is not None
    return cuda and kernels.varlen_applies(q, v, variant.get("window"), variant.get("softcap"), sinks)


def check(q, k, v, docs, scale, dtype, sinks=None, **variant) -> bool:
    """Flex and varlen vs the dense-mask SDPA path (soft-capped or with sinks: transformers' eager math), each against
    float32 SDPA; gradients where flex has a backward; varlen where it runs (CUDA, plain document masks, bf16 /
    fp16), and an error it raises counts as a failure. ``sinks`` (H,): attention sinks (gpt-oss) on both paths (the
    flex one by its log-sum-exp correction), their gradient checked too; ``variant``: ``document_attention``'s
    window / softcap."""
    device = q.device
    grad_out = torch.randn(q.shape[:-1] + v.shape[-1:], device=device, generator=torch.Generator(device).manual_seed(1))
    grad_out = grad_out.to(dtype)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)

    def attend(kernel):
        def fn(*t):
            sink = t[3] if len(t) > 3 else None
            return kernels.document_attention(*t[:3], docs, scale, kernel=kernel, sinks=sink, **variant)

        return fn

    reference = forward_backward(attend("sdpa"), [t.float() for t in inputs], grad_out.float())
    sdpa = forward_backward(attend("sdpa"), inputs, grad_out)
    if device.type == "cuda":
        flex = forward_backward(attend("flex"), inputs, grad_out)
    else:  # no CPU backward for FlexAttention: output only
        flex = [attend("flex")(*inputs)]
    ok, varlen, varlen_note = True, [], "n/a (CUDA, plain document masks, bf16 / fp16 only)"
    if varlen_runs(q, v, sinks, **variant):
        try:
            varlen = forward_backward(attend("varlen"), inputs, grad_out)
        except Exception as err:  # noqa: BLE001 - never run on a GPU before: say what broke, fail the check
            ok, varlen_note = False, f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    print(f"relative error vs float32 SDPA + dense mask (pass: flex, varlen <= {TOLERANCE[dtype]:g})")
    names = ("out", "dq", "dk", "dv", "dsinks")
    for name, want, got_sdpa, got_flex, got_varlen in zip(
        names, reference, sdpa, flex + [None] * 4, varlen + [None] * 5
    ):
        flex_err = "n/a (no CPU backward)" if got_flex is None else f"{relative_error(got_flex, want):.2e}"
        varlen_err = varlen_note if got_varlen is None else f"{relative_error(got_varlen, want):.2e}"
        print(
            f"  {name}: sdpa {str(dtype)[6:]} {relative_error(got_sdpa, want):.2e}   flex {flex_err}   "
            f"varlen {varlen_err}"
        )
        ok &= got_flex is None or relative_error(got_flex, want) <= TOLERANCE[dtype]
        ok &= got_varlen is None or relative_error(got_varlen, want) <= TOLERANCE[dtype]
    return ok


def check_compiled_varlen(q, k, v, args, scale, dtype) -> bool:
    """The varlen path as training runs it, inside ``torch.compile`` with the lengths in a prepared cache: output and
    q/k/v gradients against the eager varlen path, for two micro-batches with different counts of documents; one
    compile expected (the lengths' size is marked dynamic)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(
        lambda q, k, v, cache: kernels.document_attention(q, k, v, None, scale, kernel="varlen", cache=cache),
        backend=counter,
    )
    ok = True
    for documents in (args.documents, args.documents + 3):
        gen = torch.Generator().manual_seed(args.seed + documents)
        host_docs = packed_document_ids(args.batch, args.seq_len, documents, gen)
        cache = {}
        kernels.prepare_masks(
            cache, None, q.device, args.seq_len, kernel="varlen", lengths=kernels.document_lengths(host_docs)
        )
        grad_out = torch.randn(q.shape, device=q.device, generator=torch.Generator(q.device).manual_seed(2)).to(dtype)
        eager = forward_backward(
            lambda *t: kernels.document_attention(*t, host_docs.to(q.device), scale, kernel="varlen"),
            (q, k, v),
            grad_out,
        )
        got = forward_backward(lambda *t, c=cache: compiled(*t, c), (q, k, v), grad_out)
        errors = [relative_error(g, w) for g, w in zip(got, eager)]
        print(
            f"  compiled varlen, {documents} documents per row: out / dq / dk / dv vs eager varlen "
            + " / ".join(f"{e:.1e}" for e in errors)
        )
        ok &= all(e <= TOLERANCE[dtype] for e in errors)
    print(f"  compiles: {counter.frame_count} (1 expected: the count of documents does not recompile)")
    return ok


def time_ms(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_mask_build(build, iters: int, device: torch.device) -> float:
    def once():
        build()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return time_ms(once, iters, 2, device)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device).manual_seed(args.seed)
    host_docs = packed_document_ids(args.batch, args.seq_len, args.documents, torch.Generator().manual_seed(args.seed))
    docs = host_docs.to(device)
    q, k, v = (
        torch.randn(args.batch, heads, args.seq_len, dim, device=device, generator=gen).to(dtype)
        for heads, dim in (
            (args.heads, args.head_dim),
            (args.kv_heads, args.head_dim),
            (args.kv_heads, args.value_head_dim or args.head_dim),
        )
    )
    scale = args.head_dim**-0.5
    variant = {"window": args.window, "softcap": args.softcap}
    print(
        f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, "
        f"{args.dtype}, batch {args.batch}, heads {args.heads}/{args.kv_heads}, seq {args.seq_len}, "
        f"head dim {args.head_dim}, {args.documents} documents per row"
        + (f", value head dim {args.value_head_dim}" if args.value_head_dim else "")
        + (f", soft cap {args.softcap:g}" if args.softcap else "")
        + (f", window {args.window}" if args.window else "")
    )
    if device.type != "cuda":
        print("CPU run: FlexAttention runs eagerly and forward only; timings are CPU-only, not comparable to a GPU")

    t0 = time.perf_counter()
    kernels.document_attention(q, k, v, docs, scale, kernel="flex", **variant)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"first flex call{' (compiles)' if device.type == 'cuda' else ''}: {time.perf_counter() - t0:.1f} s")

    sinks = torch.randn(args.heads, device=device, generator=gen).to(dtype) if args.sinks else None
    ok = check(q, k, v, docs, scale, dtype, sinks, **variant)
    if varlen_runs(q, v, sinks, **variant):
        try:
            ok &= check_compiled_varlen(q, k, v, args, scale, dtype)
        except Exception as err:  # noqa: BLE001 - never run on a GPU before: say what broke, fail the check
            ok = False
            print(f"  compiled varlen FAILED: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    timed_sinks = None if sinks is None else sinks.detach()  # the timings run the sink path too (no sink gradient)

    grad_out = torch.randn(q.shape[:-1] + v.shape[-1:], device=device, dtype=dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    caches = {"doc": {}, "causal": {}, "varlen": {}, "varlen-causal": {}}
    varlen = varlen_runs(q, v, timed_sinks, **variant)
    lengths = kernels.document_lengths(host_docs)  # what training's host_document_bounds makes
    if varlen:  # the lengths as training makes them: on the host, copied once (kernels.prepare_masks)
        kernels.prepare_masks(caches["varlen"], docs, device, args.seq_len, kernel="varlen", lengths=lengths)
        rows = kernels.document_lengths(None, rows=args.batch, length=args.seq_len)
        kernels.prepare_masks(caches["varlen-causal"], None, device, args.seq_len, kernel="varlen", lengths=rows)

    def step(kernel, doc_ids, cache, backward=True):
        inputs = leaves if backward else [t.detach() for t in leaves]  # flex refuses CPU inputs that need grad

        def run():
            out = kernels.document_attention(
                *inputs, doc_ids, scale, kernel=kernel, cache=cache, sinks=timed_sinks, **variant
            )
            if backward:
                out.backward(grad_out)
                for t in leaves:
                    t.grad = None

        return run

    flex_backward = device.type == "cuda"
    cases = [
        ("SDPA causal, no document mask", step("sdpa", None, None)),
        ("SDPA + dense document mask", step("sdpa", docs, caches["doc"])),
        ("flex + document block mask", step("flex", docs, caches["doc"], flex_backward)),
        ("flex causal block mask", step("flex", None, caches["causal"], flex_backward)),
    ]
    if varlen:
        cases += [
            ("varlen + document lengths", step("varlen", docs, caches["varlen"])),
            ("varlen, one document per row", step("varlen", None, caches["varlen-causal"])),
        ]
    print(f"median of {args.iters} (after {args.warmup} warm-up), masks prebuilt:")
    for name, fn in cases:
        what = "fwd+bwd" if flex_backward or not name.startswith("flex") else "fwd only"
        try:
            print(f"  {name:32s} {what:8s} {time_ms(fn, args.iters, args.warmup, device):8.3f} ms")
        except Exception as err:  # noqa: BLE001 - the varlen path has not run on a GPU before
            ok = False
            print(f"  {name:32s} {what:8s} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    if not varlen:
        print("  varlen: n/a here (CUDA, torch with varlen attention, plain document masks, bf16 / fp16 only)")
    builds = [
        ("dense (B,1,S,S) mask build", lambda: kernels.dense_document_mask(docs, device)),
        ("flex block mask build", lambda: kernels.document_block_mask(docs, device, args.seq_len)),
        (
            "varlen lengths (host) + copy",
            lambda: kernels.prepare_masks({}, None, device, 0, (), "varlen", kernels.document_lengths(host_docs)),
        ),
    ]
    print("once per micro-batch:")
    for name, build in builds:
        print(f"  {name:32s} {'':8s} {time_mask_build(build, max(args.iters // 5, 3), device):8.3f} ms")
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        sys.exit(main())
