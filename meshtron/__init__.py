"""meshtron: train Hugging Face causal language models with data, tensor, context and pipeline parallelism."""

__version__ = "0.1.0"
