"""What every rank imports, for a process that ranks are then forked from: the forkserver of ``meshtron train|eval
--nproc`` (meshtron.launch) and of ``meshtron check`` (meshtron.check.runner), and the test launchers. Imported
there once, the modules cost a rank nothing (each fresh rank spent ~5 s of CPU importing them).

CUDA must stay uninitialized in such a process: a child forked after CUDA's initialization cannot use it ("Cannot
re-initialize CUDA in forked subprocess"). Some packages ask the device at import time (torchao, which transformers
imports when it is installed, calls ``torch.cuda.get_device_capability()``): while these modules are imported, that
question is answered from NVML, which initializes nothing (``capability_from_nvml``). Whatever initializes CUDA
anyway is seen by ``initialized_cuda_before_forking``, and the launchers then start fresh processes instead.
"""

from __future__ import annotations

import contextlib
import os
import sys


def import_rank_modules() -> None:
    """Import what every rank would otherwise import again (transformers' model classes of meshtron's families,
    torch's parallel APIs, the training loop). Nothing here starts a thread, touches a tensor or initializes CUDA
    (a fork keeps none of them safely)."""
    import importlib
    import logging

    # torch.cuda.is_available() (called by some imports) asks NVML instead of initializing CUDA, which would leave
    # the forked ranks unable to use it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    # As meshtron.known_noise quiets them: torchao (imported by transformers' quantizers) logs its unloadable CUDA
    # kernels on CPU builds, and torch 2.13 warns about its Enums registered as pytree constants.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage()
    )

    with device_questions_without_cuda(), noting_cuda_touches():
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from meshtron.models.families import FAMILIES

        for module in (
            "transformers.modeling_utils",
            "torch.distributed.pipelining",
            "torch.distributed.fsdp",
            "torch.distributed.tensor.parallel",
            "torch.distributed.checkpoint.state_dict",
            "meshtron.train.trainer",
            "meshtron.train.setup.preflight",
        ):
            importlib.import_module(module)
        for model_type in FAMILIES:
            getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


@contextlib.contextmanager
def device_questions_without_cuda():
    """Within: ``torch.cuda.get_device_capability()`` asked before CUDA is initialized answers from NVML (where
    NVML answers; else it initializes CUDA as usual, which ``initialized_cuda_before_forking`` then reports). A
    module that keeps a reference to the function keeps an answer that is right in a rank too."""
    import torch

    asked = torch.cuda.get_device_capability

    def capability(device=None) -> tuple[int, int]:
        if not torch.cuda.is_initialized() and device in (None, 0):
            answer = capability_from_nvml(0)
            if answer is not None:
                return answer
        return asked(device)

    torch.cuda.get_device_capability = capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = asked


CUDA_TOUCHES: list[str] = []
"""What first initialized CUDA, or counted the devices through the CUDA runtime (after which torch marks a forked child
as unable to use CUDA too), while this process imported the rank modules: the call and the frames that made it."""

CUDA_TOUCHING_CALLS = (
    ("torch.cuda", "_lazy_init"),
    ("torch._C", "_cuda_getDeviceCount"),
    ("torch._C", "_cuda_getArchFlags"),
)
"""torch's calls that initialize CUDA or poison forks (torch/csrc/cuda/Module.cpp: ``poison_fork()``)."""


@contextlib.contextmanager
def noting_cuda_touches():
    """Within: the first of ``CUDA_TOUCHING_CALLS`` made is noted in ``CUDA_TOUCHES`` (the forkserver's probe child
    names it when it finds CUDA initialized: ``initialized_cuda_before_forking``)."""
    import importlib

    replaced = []
    for module_name, name in CUDA_TOUCHING_CALLS:
        owner = importlib.import_module(module_name)
        call = getattr(owner, name, None)
        if call is not None:
            replaced.append((owner, name, call))
            setattr(owner, name, _noted(f"{module_name}.{name}", call))
    try:
        yield
    finally:
        for owner, name, call in replaced:
            setattr(owner, name, call)


def _noted(what: str, call):
    def noting(*args, **kwargs):
        if not CUDA_TOUCHES:
            import traceback

            frames = traceback.extract_stack()[-7:-1]
            where = " < ".join(
                f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno}" for frame in reversed(frames)
            )
            CUDA_TOUCHES.append(f"{what}() from {where}")
        return call(*args, **kwargs)

    return noting


def capability_from_nvml(index: int) -> tuple[int, int] | None:
    """The compute capability of visible CUDA device ``index`` as NVML reports it (no CUDA context is created), or
    None where NVML is missing or cannot say. Never run on a GPU."""
    from ctypes import CDLL, byref, c_int, c_void_p

    import torch

    handle, major, minor = c_void_p(), c_int(), c_int()
    try:
        nvml = CDLL("libnvidia-ml.so.1")
        physical = torch.cuda._get_nvml_device_index(index)  # CUDA_VISIBLE_DEVICES taken into account
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            answered = (
                nvml.nvmlDeviceGetHandleByIndex_v2(physical, byref(handle)) == 0
                and nvml.nvmlDeviceGetCudaComputeCapability(handle, byref(major), byref(minor)) == 0
            )
        finally:
            nvml.nvmlShutdown()
    except (OSError, RuntimeError, ValueError, AttributeError, IndexError):  # IndexError: no device visible
        return None
    return (major.value, minor.value) if answered else None


def cuda_initialized_here() -> bool:
    """Whether this process, or the process it was forked from, has initialized CUDA (a child forked after that
    cannot use CUDA: torch calls it a bad fork)."""
    import torch

    return bool(torch.cuda._initialized) or torch.cuda._is_in_bad_fork()


CUDA_INITIALIZED_EXIT = 3
"""The exit status of ``_exit_with_cuda_state``'s process when the process it was forked from had initialized CUDA."""


def initialized_cuda_before_forking(context) -> bool:
    """Whether the process that multiprocessing's ``context`` forks from (its forkserver, started if it is not yet)
    has initialized CUDA: one child forked from it says so by its exit status. Asked before any rank is forked."""
    probe = context.Process(target=_exit_with_cuda_state)
    probe.start()
    probe.join()
    return probe.exitcode == CUDA_INITIALIZED_EXIT


def _exit_with_cuda_state() -> None:
    if not cuda_initialized_here():
        os._exit(0)
    if CUDA_TOUCHES:  # the launchers' line says what follows; this one says what did it
        print(f"meshtron: the forkserver's CUDA was touched by {CUDA_TOUCHES[0]}", file=sys.stderr, flush=True)
    os._exit(CUDA_INITIALIZED_EXIT)
