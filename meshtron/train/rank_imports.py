"""What every rank imports, for a process that ranks are then forked from: the forkserver of ``meshtron train|eval
--nproc`` (meshtron.launch) and of ``meshtron check`` (meshtron.check.runner), and the test launchers. Imported
there once, the modules cost a rank nothing (each fresh rank spent ~5 s of CPU importing them)."""

from __future__ import annotations

import os


def import_rank_modules() -> None:
    """Import what every rank would otherwise import again (transformers' model classes of meshtron's families,
    torch's parallel APIs, the training loop). Nothing here starts a thread, touches a tensor or initializes CUDA
    (a fork keeps none of them safely)."""
    import importlib
    import logging

    # torch.cuda.is_available() (called by some imports) asks NVML instead of initializing CUDA, which would leave
    # the forked ranks unable to use it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    # As meshtron.cli quiets them: torchao (imported by transformers' quantizers) logs its unloadable CUDA kernels on
    # CPU builds, and torch 2.13 warns about its Enums registered as pytree constants.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage()
    )

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
        "meshtron.train.preflight",
    ):
        importlib.import_module(module)
    for model_type in FAMILIES:
        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
