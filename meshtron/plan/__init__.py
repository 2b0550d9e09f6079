"""``meshtron plan``: per-rank memory and step-time estimates for every layout of a model on a cluster."""
