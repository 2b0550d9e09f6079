"""Imported once by the forkserver of ``meshtron check`` (multiprocessing's preload): what every rank imports."""

from meshtron.train.setup.rank_imports import import_rank_modules

import_rank_modules()
