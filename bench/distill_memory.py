"""Peak CPU memory of the distillation loss on the head (meshtron.train.loss.distill), fused in chunks vs unfused.

Each (tokens, vocabulary, path) runs in a fresh process: one forward and backward of ``distill_loss_sum`` (float32,
student hidden size ``--hidden``, teacher ``--teacher-hidden``, ``--divergence``, temperature 2, alpha 0.5) after a
tiny warm-up call of both paths. Memory is the process's resident set (Linux ``/proc/self/status``): its high-water
mark ``VmHWM`` is reset to the current ``VmRSS`` once the inputs exist (``/proc/self/clear_refs``), so the figure is
the peak above the inputs (hidden states, heads, labels) that the loss's forward and backward added, gradients of the
student's hidden states and head included (``tokens x hidden`` and ``vocab x hidden`` float32, which any path
produces). ``tracemalloc`` would not see torch's allocator; RSS does. The median of ``--repeats`` processes.

    python bench/distill_memory.py                                   # tokens 512, 2048 x vocab 8192, 32768
    python bench/distill_memory.py --tokens 256 --vocab 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20

CHILD = """
import json, sys
import torch
from meshtron.train.loss.distill import DistillOptions, distill_loss_sum


def status_kib(field):
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith(field + ":"))


def run(tokens, vocab, hidden, teacher_hidden, chunk_size, options, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, tokens, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).requires_grad_()
    th = torch.randn(1, tokens, teacher_hidden, generator=gen)
    tw = torch.randn(vocab, teacher_hidden, generator=gen) * teacher_hidden**-0.5
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    return h, w, th, tw, labels


def step(inputs, chunk_size, options):
    h, w, th, tw, labels = inputs
    loss, sums = distill_loss_sum(h, th, labels, w, None, tw, None, options, chunk_size=chunk_size)
    loss.backward()
    return loss.item()


case = json.loads(sys.argv[1])
options = DistillOptions(case["divergence"], temperature=2.0, alpha=0.5)
shape = (case["tokens"], case["vocab"], case["hidden"], case["teacher_hidden"], case["chunk_size"])
if case["warm_up"]:  # the same call once first: lazy initialisation (autograd, BLAS kernels) outside the peak
    step(run(*shape, options, seed=1), case["chunk_size"], options)
inputs = run(*shape, options)
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # VmHWM := VmRSS
before = status_kib("VmRSS")
step(inputs, case["chunk_size"], options)
print("RESULT " + json.dumps({"before_kib": before, "peak_kib": status_kib("VmHWM")}))
"""


def measure_once(case: dict) -> float:
    """Bytes above the inputs at the peak of one forward and backward, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True, env=env, cwd=REPO
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    found = json.loads(lines[-1][len("RESULT ") :])
    return (found["peak_kib"] - found["before_kib"]) * 1024.0


def measure(case: dict, repeats: int) -> float:
    runs = sorted(measure_once(case) for _ in range(repeats))
    return runs[len(runs) // 2]


def rows(args) -> list[dict]:
    """One row per (tokens, vocabulary): the peak above the inputs of the unfused and the fused path."""
    found = []
    for tokens in args.tokens:
        for vocab in args.vocab:
            base = dict(
                tokens=tokens,
                vocab=vocab,
                hidden=args.hidden,
                teacher_hidden=args.teacher_hidden,
                divergence=args.divergence,
                warm_up=not args.no_warm_up,
            )
            unfused = measure({**base, "chunk_size": 0}, args.repeats)
            fused = measure({**base, "chunk_size": args.chunk_size}, args.repeats)
            found.append({**base, "chunk_size": args.chunk_size, "unfused_bytes": unfused, "fused_bytes": fused})
    return found


def table(found: list[dict]) -> str:
    lines = [
        "| tokens | vocab | one fp32 logits (MiB) | unfused peak (MiB) | fused peak (MiB) | unfused / token (KiB) "
        "| fused / token (KiB) | unfused / fused |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in found:
        tokens, vocab = row["tokens"], row["vocab"]
        unfused, fused = row["unfused_bytes"], row["fused_bytes"]
        lines.append(
            f"| {tokens} | {vocab} | {tokens * vocab * 4 / MIB:.0f} | {unfused / MIB:.0f} | {fused / MIB:.0f} "
            f"| {unfused / tokens / 1024:.0f} | {fused / tokens / 1024:.0f} | {unfused / max(fused, 1):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--teacher-hidden", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk of the fused path")
    parser.add_argument("--divergence", default="jsd", choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--repeats", type=int, default=1, help="processes per figure (the median is shown)")
    parser.add_argument("--no-warm-up", action="store_true", help="measure the first call (lazy set-up included)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    found = rows(args)
    if args.json:
        args.json.write_text(json.dumps(found))
    print(
        f"distill_loss_sum forward + backward, CPU, float32, {args.divergence}, hidden {args.hidden}, teacher hidden "
        f"{args.teacher_hidden}, fused chunks of {args.chunk_size} tokens: peak RSS above the inputs, median of "
        f"{args.repeats} process(es)"
    )
    print(table(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
