"""Activation memory: what autograd keeps for backward, measured (``measure.py``: saved-tensor hooks), and the three
ways a run makes it smaller, one module each: activation checkpointing (``checkpointing.py``: blocks recompute their
forward in backward), activation offloading (``offload.py``: kept tensors wait in host memory) and the tiled MLP
(``tiled_mlp.py``: an MLP keeps only its input). ``parallelize`` applies checkpointing and tiling to the model; the
step holds the offloading and measuring hooks around its forwards."""
