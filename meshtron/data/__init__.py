"""Data pipeline: tokenizers, document sources, packing, the packed dataset and the global batch order."""
