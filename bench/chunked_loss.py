"""What the chunked head + cross-entropy saves: bytes autograd keeps for backward and the peak of one
loss forward + backward, chunked vs all logits at once, at a real head shape.

Default: Llama-3.2-1B's head (hidden 2048, vocab 128,256), bf16 compute, 2,048 tokens (one sequence;
everything here is linear in the token count, so a batch of 4 x 2048 is 4x these figures).
On CUDA it also reports the peak memory of the loss's forward + backward (torch.cuda.max_memory_allocated
above what was allocated before); on CPU only the bytes kept for backward are meaningful.

    python bench/chunked_loss.py [--tokens 2048] [--hidden 2048] [--vocab 128256] [--chunk 4096 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshtron.distributed.activation_memory.measure import SavedActivationTracker  # noqa: E402
from meshtron.train.loss.head import head_loss_sum  # noqa: E402


def measure(tokens: int, hidden: int, vocab: int, chunk: int, device: torch.device) -> tuple[int, float]:
    torch.manual_seed(0)
    weight = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_()
    hidden_states = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    tracker = SavedActivationTracker()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with tracker.track():
        loss = head_loss_sum(hidden_states, labels, weight, compute_dtype=torch.bfloat16, chunk_size=chunk)
    loss.backward()
    peak = (torch.cuda.max_memory_allocated(device) - before) / 1e9 if device.type == "cuda" else None
    return tracker.peak_bytes, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk", type=int, nargs="+", default=[1024])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"head {args.vocab} x {args.hidden}, {args.tokens} tokens, bf16 compute, {device.type}")
    print("| loss | kept for backward | peak growth |\n| --- | ---: | ---: |")
    for chunk in [0] + sorted(args.chunk):
        kept, peak = measure(args.tokens, args.hidden, args.vocab, chunk, device)
        name = "all logits at once" if chunk == 0 else f"chunks of {chunk} tokens"
        print(f"| {name} | {kept / 1e9:.3f} GB | {'n/a (CPU)' if peak is None else f'{peak:.2f} GB'} |")


if __name__ == "__main__":
    main()
