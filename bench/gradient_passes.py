"""Which operators launched a trace's elementwise add and copy kernels: the gradients' extra passes, if any.

Reads a Chrome trace that ``run.profile_steps`` (or torch.profiler) wrote on CUDA and, for every kernel whose name
matches ``--kernels`` (by default the float32 adds and the copies / casts), finds the CPU operator that launched it
(the kernel's "External id") and the operators around that one, and prints milliseconds per step by (kernel, call
stack). On the H100 trace of issue 44 (llama-1b, bf16 compute, fp32 master weights, one micro-batch) it showed the
fused loss's per-chunk float32 head-gradient adds (4.4 ms a step), the tied weight's two float32 gradients added
(1.0 ms) and the head's second cast and its gradient's double rounding. Example:

    python bench/gradient_passes.py ../shared/gpu-measurements/h100-llama-1b-b8-steps5-7.trace.json.gz --steps 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def attribute(events: list[dict], kernels: str, depth: int = 4) -> Counter:
    """Microseconds by (kernel name, the launching operator's innermost ``depth`` enclosing CPU operators)."""
    operators = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    launched_by = defaultdict(list)
    for op in operators:
        if "External id" in op.get("args", {}):
            launched_by[op["args"]["External id"]].append(op)
    times: Counter = Counter()
    pattern = re.compile(kernels)
    for kernel in (e for e in events if e.get("cat") == "kernel" and pattern.search(e["name"])):
        ops = launched_by.get(kernel.get("args", {}).get("External id"), [])
        if not ops:
            times[(kernel["name"][:80], "?")] += kernel["dur"]
            continue
        op = min(ops, key=lambda e: e["dur"])
        stack = [
            e["name"]
            for e in operators
            if e["tid"] == op["tid"] and e["ts"] <= op["ts"] and e["ts"] + e["dur"] >= op["ts"] + op["dur"]
        ]
        times[(kernel["name"][:80], " > ".join(stack[-depth:]))] += kernel["dur"]
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds (for per-step figures)")
    parser.add_argument("--kernels", default=r"CUDAFunctor_add<float>|direct_copy|bfloat16_copy|CopyFunctor|fill")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    times = attribute(load_events(args.trace), args.kernels)
    for (kernel, stack), micros in times.most_common(args.top):
        print(f"{micros / 1000 / args.steps:8.3f} ms/step  {kernel}\n                   {stack}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
