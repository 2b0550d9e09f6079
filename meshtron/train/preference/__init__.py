"""Preference objectives in training (``train.objective`` dpo, ipo, simpo, orpo; docs/post-training.md): the targets a
micro-batch carries, the loss on the head, and the reference model."""
