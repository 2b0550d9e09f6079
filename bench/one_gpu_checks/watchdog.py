"""Issue 43, findings 6 and 10 on one GPU (a 1-rank NCCL group): the flight recorder is on, a stream with queued
work counts as waiting, and the hang watchdog writes and names the recorder's trace when it gives up. Run from the
repository root: ``PYTHONPATH=$PWD python bench/one_gpu_checks/watchdog.py``."""

import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

print("torch", torch.__version__, "cuda", torch.cuda.is_available(), flush=True)
if not torch.cuda.is_available():
    sys.exit(0)
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
import torch.distributed as dist  # noqa: E402
from torch.distributed import HashStore  # noqa: E402

from meshtron.resilience.process_group import init_runtime, shutdown_runtime  # noqa: E402
from meshtron.resilience.watchdog import HangWatchdog, device_stream_pending, flight_recorder_trace  # noqa: E402

runtime = init_runtime(timeout_s=120, device="cuda")
print("backend", dist.get_backend(), "TORCH_NCCL_TRACE_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
print("has _dump_nccl_trace", hasattr(torch._C._distributed_c10d, "_dump_nccl_trace"))
x = torch.ones(1 << 20, device=runtime.device)
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
trace = pickle.loads(flight_recorder_trace())
print("flight recorder entries", len(trace["entries"]), [e.get("profiling_name") for e in trace["entries"][-3:]])

pending = device_stream_pending(runtime.device)
print("pending, idle stream:", pending())
torch.cuda._sleep(3_000_000_000)  # seconds of queued GPU work; the host returns at once
print("pending, kernel queued:", pending())
folder = Path(tempfile.mkdtemp())
lines = []


class Stream:
    def write(self, text):
        lines.append(text)

    def flush(self):
        pass


watchdog = HangWatchdog(
    0,
    1,
    0.1,
    HashStore(),
    poll_s=0.05,
    report_wait_s=0.5,
    exit=lambda code: lines.append(f"exit {code}"),
    stream=Stream(),
    stream_pending=pending,
    trace_dir=folder,
    locate=lambda: (False, "step.py:250 in train_step"),
)
give_up = threading.Thread(target=watchdog.give_up, args=(1.0,))
give_up.start()
give_up.join(20)
print("watchdog said:", "".join(lines))
print("trace files:", sorted(str(p.relative_to(folder)) for p in folder.rglob("*")))
torch.cuda.synchronize()
print("pending after sync:", pending())
started = time.perf_counter()
shutdown_runtime()
print("ok", round(time.perf_counter() - started, 2))
