"""Imported once by the forkserver that ``meshtron train|eval --nproc`` forks its workers from (meshtron.launch)."""

import contextlib
import gc
import os
import signal

# First, a session of its own, as torchrun gives each fresh worker: a terminal's Ctrl-C then reaches the launcher alone
# (not this process's imports, nor the workers directly), which sends it on to every worker once
# (meshtron.resilience.launcher_signals); a second Ctrl-C stops them at once.
with contextlib.suppress(OSError):
    os.setsid()

from meshtron.launch import FORKSERVER_IGNORED_SIGNALS  # noqa: E402
from meshtron.train.setup.rank_imports import import_rank_modules  # noqa: E402

import_rank_modules()  # CUDA left uninitialized: meshtron.launch.rank_start_for checks it before any worker is forked
# A stop signal sent to every process of the job (SLURM's scancel) must not end the forkserver: the
# kernel would then send its workers SIGINT (torch.multiprocessing makes it their parent-death signal) in the middle
# of the checkpoint they save on the stop signal. Each worker takes the default back (launch.run_forked_rank).
for _name in FORKSERVER_IGNORED_SIGNALS:
    signal.signal(getattr(signal, _name), signal.SIG_IGN)
# Every object imported so far moves to a generation the collector never scans: a worker's collections then do not
# write into the pages it shares with the forkserver (copy-on-write).
gc.freeze()
