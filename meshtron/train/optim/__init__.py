"""Optimizers (AdamW, Muon) and the learning-rate schedule."""
