"""Runs a worker script on N processes forked from this one: what ``torchrun --nproc-per-node N SCRIPT ARGS`` does
for a test, without N fresh interpreters each importing torch and transformers again (~6 s of CPU each).

Usage: python tests/fork_launch.py N SCRIPT [ARGS...]
SCRIPT defines ``main()`` and joins its process group from the environment (``dist.init_process_group("gloo")``
or ``init_runtime()``): each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT as torchrun sets them, and ``sys.argv`` = [SCRIPT, ARGS...]. The first rank that fails (an exception,
a non-zero exit) stops the others and this process exits non-zero. Launching through torchrun itself is covered by
the CLI, recovery and error tests.
"""

import gc
import multiprocessing
import os
import runpy
import sys
import traceback

from parity_worker import check_cuda_uninitialized, fork_ranks, import_before_forking, set_rank_environment


def main() -> None:
    world, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    import_before_forking()
    worker = runpy.run_path(script, run_name="forked_worker")  # its imports happen here, once
    gc.freeze()  # see parity_worker.main
    check_cuda_uninitialized()

    def run(rank: int, port: int) -> None:
        set_rank_environment(rank, world, port)
        sys.argv = [script, *args]
        try:
            worker["main"]()
        except SystemExit as stop:  # sys.exit(code or message), as the interpreter would end
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1))
        except BaseException:
            print(f"[rank{rank}] {script} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    fork_ranks(multiprocessing.get_context("fork"), world, run, script, timeout_s=3600)


if __name__ == "__main__":
    main()
