"""Imported once by the forkserver of ``meshtron check`` (multiprocessing's preload): what every rank imports."""

from meshtron.check.worker import import_before_forking

import_before_forking()
