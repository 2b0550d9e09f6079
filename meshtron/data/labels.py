"""What labels mean to every loss in meshtron."""

IGNORE_INDEX = -100
"""Label value that carries no loss (PyTorch's and Hugging Face's default ``ignore_index``)."""

NLL_ONLY_LABELS_BELOW = IGNORE_INDEX
"""A preference row's label below IGNORE_INDEX marks a target that only a preference objective's NLL term counts
(ORPO's: the chosen sequence's prompt tokens, as TRL's ORPOTrainer counts them): the label of token ``t`` is
``IGNORE_INDEX - 1 - t`` (meshtron.data.preference writes it, meshtron.train.loss.preference reads it)."""
