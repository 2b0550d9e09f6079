"""The training loss: the head and cross-entropy over the final hidden states (fused in chunks by default), the
preference and distillation losses on the head, and fp16's dynamic loss scaling."""
