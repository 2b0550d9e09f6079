"""Imported once by the forkserver that ``meshtron train|eval --nproc`` forks its workers from (meshtron.launch)."""

import gc
import signal

from meshtron.launch import FORKSERVER_IGNORED_SIGNALS
from meshtron.train.rank_imports import import_rank_modules

import_rank_modules()
# A stop signal sent to the whole process group (SLURM's scancel, kill -TERM -PGID) must not end the forkserver: the
# kernel would then send its workers SIGINT (torch.multiprocessing makes it their parent-death signal) in the middle
# of the checkpoint they save on the stop signal. Each worker takes the default back (launch.run_forked_rank).
for _name in FORKSERVER_IGNORED_SIGNALS:
    signal.signal(getattr(signal, _name), signal.SIG_IGN)
# Every object imported so far moves to a generation the collector never scans: a worker's collections then do not
# write into the pages it shares with the forkserver (copy-on-write).
gc.freeze()
