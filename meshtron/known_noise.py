"""Log records that say nothing to a meshtron user and that meshtron cannot act on, dropped in every process that
runs a command or a rank (``quiet_known_noise``)."""

from __future__ import annotations

import logging


class KnownNoise(logging.Filter):
    """Drops log records that say nothing to a meshtron user and that meshtron cannot act on."""

    PHRASES = (
        # torchao (imported by transformers' quantizers whenever it is installed) registers its Enums as pytree
        # constants, which torch 2.13 deprecates: two lines per process at every start.
        "is an Enum subclass and is now natively supported by torch.compile",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(phrase in message for phrase in self.PHRASES)


_KNOWN_NOISE = KnownNoise()
"""One filter for every call of main (tests call it many times in one process): addFilter adds it once."""


def quiet_known_noise() -> None:
    """Quiet the known noise of torchao and torch's pytree in this process (idempotent)."""
    # transformers imports torchao when it is installed; on CPU builds it logs its unloadable CUDA kernels.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(_KNOWN_NOISE)
