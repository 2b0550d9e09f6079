"""Distillation (``train.objective=distill``): the frozen teacher under the run's layout and the loss on both heads."""
