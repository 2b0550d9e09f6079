"""The checks of a layout against a model and a workload: one list, run by ``meshtron train``'s preflight on
the run's config and by the planner on every candidate layout, so the two cannot disagree."""

from __future__ import annotations

from meshtron.config import ParallelConfig
from meshtron.distributed.context_parallel import check_context_parallel, check_ulysses
from meshtron.distributed.expert_parallel import check_expert_parallel
from meshtron.distributed.mesh import ParallelDims
from meshtron.distributed.pipeline_parallel import check_pipeline
from meshtron.distributed.tensor_parallel import check_tensor_parallel
from meshtron.errors import ConfigError
from meshtron.models.adapter import adapter_for
from meshtron.models.attention import check_attention
from meshtron.models.families import check_family


def check_layout(
    hf_config,
    parallel: ParallelConfig,
    dims: ParallelDims,
    *,
    seq_len: int,
    mask_documents: bool,
    attn_implementation: str,
    local_batch: int,
    micro_batch_size: int | None,
    device_type: str,
) -> int:
    """Raise a one-line ConfigError where ``hf_config`` cannot run with the degrees ``dims`` (resolved from
    ``parallel`` by ``ParallelDims.from_config``) and these data and attention settings; returns the number of
    pipeline microbatches (1 without pipeline parallelism).

    ``local_batch``: sequences per data-parallel rank per step; ``micro_batch_size``: ``train.micro_batch_size``,
    or None (see ``check_pipeline``).
    """
    check_family(hf_config, tp=dims.tp, attn_implementation=attn_implementation)
    check_expert_parallel(hf_config, dims.ep)
    check_context_parallel(dims.cp, seq_len)
    if dims.cp > 1 and parallel.cp_method in ("ulysses", "hybrid"):
        shape = adapter_for(hf_config).attention_shape(hf_config)
        hybrid = parallel.cp_method == "hybrid"
        degree = parallel.cp_ulysses if hybrid else dims.cp
        check_ulysses(shape.num_heads, shape.num_kv_heads, degree, dims.tp, hybrid=hybrid)
        if hybrid:
            check_mesh_unflatten()
    check_attention(hf_config, attn_implementation, dims.cp, mask_documents, parallel.cp_method)
    microbatches = check_pipeline(parallel, hf_config, local_batch, micro_batch_size, device_type)
    check_tensor_parallel(hf_config, adapter_for(hf_config), dims.tp, seq_len, parallel.sequence_parallel, dims.cp)
    return microbatches


def check_mesh_unflatten() -> None:
    """``parallel.cp_method=hybrid`` splits the cp mesh with ``DeviceMesh._unflatten`` (meshtron.distributed
    .context_parallel.hybrid), which older PyTorch releases lack: refuse before any process group work."""
    from torch.distributed.device_mesh import DeviceMesh

    if not hasattr(DeviceMesh, "_unflatten"):
        import torch

        raise ConfigError(
            f"parallel.cp_method=hybrid needs DeviceMesh._unflatten, which torch {torch.__version__} lacks; upgrade "
            "torch or use parallel.cp_method=ring or ulysses"
        )
