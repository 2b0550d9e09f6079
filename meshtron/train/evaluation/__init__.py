"""Validation during training and ``meshtron eval``'s run."""
