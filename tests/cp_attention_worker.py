"""Context-parallel attention vs single-device attention, every case in one torchrun launch of 4 ranks.

Usage: torchrun --nproc-per-node 4 tests/cp_attention_worker.py OUT.json
Methods: ring, allgather (``context_parallel_attention``) and ulysses (``ulysses_attention``, KV heads repeated at
cp=4: 2 KV heads).
cp=4 uses all ranks; cp=2 runs on ranks {0,1} and {2,3}. For each case rank 0 writes the largest
relative error (max abs error / max abs reference) of the output and of dq, dk, dv over all ranks.
Kernels: ``auto`` (CPU flash op for unmasked tiles, plain PyTorch for masked ones), ``math`` (plain
PyTorch everywhere) and, with documents, ``flex`` (masked tiles by eager FlexAttention with the
planned ``BlockMask``; forward only, as FlexAttention has no CPU backward).
Sliding-window cases (``sliding_window_cases``: windows shorter than, equal to and longer than a chunk of
16 tokens at cp=2 and of 8 at cp=4, documents crossing chunk borders inside the window) go to a second
file, OUT's name with ``.sliding_window.json`` appended.
Hybrid cases (``hybrid_cases``: ``hybrid_attention`` at cp=4 with cp_ulysses 2, and 1 and 4 at the ends; the
groups made by ``hybrid_groups`` from a 1-D cp DeviceMesh; the ring's tile plan from the host document bounds
that training passes) go to a third, OUT's name with ``.hybrid.json`` appended.
"""

import itertools
import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshtron.distributed.context_parallel import (
    SequenceLayout,
    chunk_document_bounds,
    context_parallel_attention,
    hybrid_attention,
    hybrid_groups,
    local_token_index,
    ulysses_attention,
)
from meshtron.models.attention import document_ids

SEQ, BATCH, HEADS, KV_HEADS, DIM, EOS = 64, 2, 4, 2, 16, 0


def random_tokens(generator) -> torch.Tensor:
    """Token rows with EOS at uneven places (documents of 1 to 23 tokens crossing chunk borders)."""
    tokens = torch.randint(1, 50, (BATCH, SEQ), generator=generator)
    for row, ends in enumerate(([5, 6, 29, 47], [0, 22, 23, 44, 62])):
        tokens[row, ends] = EOS
    return tokens


def reference(q, k, v, docs, scale, window=None):
    """Plain float64 attention over the whole sequence with the causal (and document, and window) mask."""
    groups = HEADS // KV_HEADS
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    visible = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if window is not None:  # transformers' sliding_window_overlay: kv_idx > q_idx - window
        visible = visible & ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(-window)
    if docs is not None:
        visible = visible & (docs[:, :, None] == docs[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v


def run_case(cp, method, masked, kernel, group, rank, window=None, hybrid=None) -> dict:
    generator = torch.Generator().manual_seed(1234)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(BATCH, KV_HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    v = torch.randn(BATCH, KV_HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    weight = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator, dtype=torch.float64)
    docs = document_ids(random_tokens(generator), EOS) if masked else None
    scale = DIM**-0.5
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference(*ref_inputs, docs, scale, window)
    (ref_out * weight).sum().backward()

    index = local_token_index(SEQ, cp, rank)
    local = [t[:, :, index].float().contiguous().requires_grad_() for t in (q, k, v)]
    bounds = chunk_document_bounds(docs, cp) if hybrid is not None and docs is not None else None
    layout = SequenceLayout(SEQ, cp, rank, group, method, docs, kernel, document_bounds=bounds, hybrid=hybrid)
    attention = {"ulysses": ulysses_attention, "hybrid": hybrid_attention}.get(method, context_parallel_attention)
    out = attention(*local, layout, scale, window)
    backward = kernel != "flex"
    if backward:
        (out * weight[:, :, index].float()).sum().backward()

    def rel(got, want):
        return float((got.double() - want[:, :, index]).abs().max() / want.abs().max())

    errors = [rel(out, ref_out.detach())] + [rel(t.grad, r.grad) for t, r in zip(local, ref_inputs) if backward]
    worst = torch.tensor(errors, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(("out", "dq", "dk", "dv"), worst.tolist()))


def sliding_window_cases():
    """(cp, method, masked, kernel, window): every window with documents, both methods, the fastest kernels;
    without documents and with the plain kernel and FlexAttention tiles (output only) a few."""
    for cp, method, window in itertools.product((2, 4), ("ring", "allgather"), (5, 8, 16, 27)):
        yield cp, method, True, "auto", window
    for cp, window in itertools.product((2, 4), (5, 16)):
        yield cp, "ring", False, "auto", window
        yield cp, "allgather", True, "math", window
    for cp, window in itertools.product((2, 4), (8, 27)):
        yield cp, "ring", True, "flex", window
    for cp, window in itertools.product((2, 4), (5, 27)):  # Ulysses: whole sequences, the device's kernel
        yield cp, "ulysses", True, "auto", window


def hybrid_cases():
    """(cp_ulysses, masked, kernel, window) at cp=4: Ulysses over pairs and a ring of two (2) with and without
    documents, every kernel, windows shorter than, equal to and (without documents, which are shorter) longer than
    the ring's chunk of 16; the ends (4: a ring of one, 1: a ring of all four) with documents."""
    for masked, kernel in ((False, "auto"), (True, "auto"), (True, "math"), (True, "flex")):
        yield 2, masked, kernel, None
    for masked, window in ((True, 5), (True, 16), (False, 27)):
        yield 2, masked, "auto", window
    for ulysses in (1, 4):
        yield ulysses, True, "auto", None


def main() -> None:
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    cases = itertools.product((2, 4), ("ring", "allgather", "ulysses"), (False, True), ("auto", "math", "flex"))
    for cp, method, masked, kernel in cases:
        if kernel == "flex" and (not masked or method == "ulysses"):
            continue  # without documents no tile is masked: the same as auto; Ulysses has no tiles
        group = dist.group.WORLD if cp == 4 else pairs[rank // 2]
        name = f"cp{cp}-{method}-{'documents' if masked else 'causal'}-{kernel}"
        results[name] = run_case(cp, method, masked, kernel, group, rank % cp)
    windowed = {}
    for cp, method, masked, kernel, window in sliding_window_cases():
        group = dist.group.WORLD if cp == 4 else pairs[rank // 2]
        name = f"cp{cp}-{method}-{'documents' if masked else 'causal'}-{kernel}-window{window}"
        windowed[name] = run_case(cp, method, masked, kernel, group, rank % cp, window)
    cp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    groups = {ulysses: hybrid_groups(cp_mesh, ulysses) for ulysses in (1, 2, 4)}
    hybrid = {}
    for ulysses, masked, kernel, window in hybrid_cases():
        name = f"cp4-hybrid-u{ulysses}-{'documents' if masked else 'causal'}-{kernel}"
        name += f"-window{window}" if window else ""
        hybrid[name] = run_case(4, "hybrid", masked, kernel, dist.group.WORLD, rank, window, groups[ulysses])
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
        with open(sys.argv[1] + ".sliding_window.json", "w") as f:
            json.dump(windowed, f, indent=1)
        with open(sys.argv[1] + ".hybrid.json", "w") as f:
            json.dump(hybrid, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
