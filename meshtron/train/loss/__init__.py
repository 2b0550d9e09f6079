"""The training loss: the head and cross-entropy over the final hidden states (fused in chunks by default), and fp16's
dynamic loss scaling."""
