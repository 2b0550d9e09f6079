"""One rank of one ``meshtron check`` run, in a process started by the forkserver (``meshtron.check.runner``).

It trains with meshtron's own loop and writes ``<run dir>/rank<R>.pt``: the per-step losses and gradient norms and
this rank's view of the full final weights (gathered from FSDP / TP shards; a pipeline rank's stages only;
replicated parameters as this rank holds them, so replicas that drift apart are seen). Its output goes to
``<run dir>/rank<R>.log``.

``BREAK_ENV`` (``MESHTRON_CHECK_BREAK=NAME``) is for tests and for seeing a failure once: the last rank of layout
NAME scales every ``nn.Linear`` output by ``BREAK_SCALE``, as a device that computes wrongly would. Not a setting.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

BREAK_ENV = "MESHTRON_CHECK_BREAK"
BREAK_SCALE = 1.01
COLLECTIVE_TIMEOUT_S = 120
"""How long a collective of a check run may wait (run.collective_timeout_s): a hang fails the layout in minutes."""
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def run_rank(job: dict) -> None:
    """Entry point of a rank: ``job`` holds rank, world, port, overrides, device, out (the run's directory), env
    (the launching process's environment), threads and broken."""
    out = Path(job["out"])
    rank = job["rank"]
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        _train_rank(job, out, rank)
    except BaseException:
        print(f"[rank{rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown of torch.distributed's C++ objects (see meshtron.exits.exit_after)


def _train_rank(job: dict, out: Path, rank: int) -> None:
    import torch

    os.environ.clear()  # the forkserver's environment is that of its start; the launcher's may have changed since
    os.environ.update(job["env"])
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    world = job["world"]
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the launcher serves the store; every rank is a client
    torch.set_num_threads(job["threads"])
    if job["device"] == "cuda":  # fp32 means fp32: no TF32 in matmuls or convolutions
        if torch.cuda._is_in_bad_fork():
            raise RuntimeError("CUDA was initialized in meshtron check's forkserver before this rank was forked")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    if job["broken"] and rank == world - 1:
        _scale_linear_outputs(BREAK_SCALE)

    from meshtron.config import load_config
    from meshtron.resilience.process_group import init_runtime, shutdown_runtime
    from meshtron.resilience.watchdog import COLLECTIVE_GRACE_S
    from meshtron.train.setup.preflight import preflight
    from meshtron.train.trainer import train

    cfg = load_config(None, list(job["overrides"]), env={})
    setup = preflight(cfg, world, job["device"])
    runtime = init_runtime(timeout_s=cfg.run.collective_timeout_s + COLLECTIVE_GRACE_S, device=cfg.run.device)
    try:
        result = train(cfg, runtime, setup)
        state = _full_state(result, world)
        torch.save({"losses": result.losses, "grad_norms": result.grad_norms, "state": state}, out / f"rank{rank}.pt")
    finally:
        shutdown_runtime()


def _full_state(result, world: int) -> dict:
    """This rank's full view of the weights of its model parts (a collective under FSDP / TP), on the CPU."""
    if world == 1:
        return {k: v.detach().cpu().clone() for k, v in result.model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = {}
    for part in result.model_parts:  # pipeline stages: each holds some of the parameters, names unchanged
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        state.update({k: v.detach().cpu().clone() for k, v in full.items()})
    return state


def _scale_linear_outputs(scale: float) -> None:
    """The deliberate defect of ``BREAK_ENV``: every ``nn.Linear`` of this process returns ``scale`` x its output."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook

    def hook(module, args, output):
        return output * scale if isinstance(module, torch.nn.Linear) else None

    register_module_forward_hook(hook)
