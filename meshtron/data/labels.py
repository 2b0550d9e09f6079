"""What labels mean to every loss in meshtron."""

IGNORE_INDEX = -100
"""Label value that carries no loss (PyTorch's and Hugging Face's default ``ignore_index``)."""
