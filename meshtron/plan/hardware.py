"""Devices and links the planner assumes: documented constants, every one overridable from the CLI.

Figures are the vendors' data-sheet numbers (dense bf16 and float8, no sparsity; memory bandwidth; NVLink per
GPU and direction; one 400 Gb/s NIC per GPU for H100/H200-class clusters, 200 Gb/s for A100) and efficiencies
that turn data-sheet peaks into what training kernels and NCCL reach in practice (the compiled step's are
fitted on measured H100 runs: meshtron.plan.calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshtron.errors import ConfigError


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and the links between them."""

    name: str
    memory_gb: float
    """Device memory in GB (1e9 bytes), as sold."""
    peak_tflops: float
    """Dense bf16 peak."""
    nvlink_gbps: float
    """GB/s per GPU per direction inside a node."""
    network_gbps: float
    """GB/s per GPU per direction between nodes."""
    fp32_tflops: float
    """Plain fp32 peak (no tensor cores; PyTorch leaves TF32 off for matmuls, and so does meshtron)."""
    gpus_per_node: int = 8
    matmul_efficiency: float = 0.35
    """Fraction of peak a training step's model FLOPs run at, before communication: meshtron measured
    32.1% MFU on one H100 (llama-1b, bf16, BENCHMARKS.md); torchtitan's eager Llama-3-8B FSDP runs
    report 33-39%. Fused-kernel stacks (NeMo / Transformer Engine) reach 50-60%."""
    compiled_matmul_efficiency: float = 0.81
    """With ``train.compile`` on, the step is modelled kernel by kernel (meshtron.plan.calibration): this is the
    fraction of the compute dtype's peak cuBLAS matmuls reach when they are large. Fitted on one H100: llama-1b,
    batch 8, seq 2048, the trace's 156.8 ms of matmul kernels a step for 121.6 TFLOP (2026-11-26)."""
    link_efficiency: float = 0.8
    """Fraction of link bandwidth NCCL collectives reach (bus bandwidth / line rate)."""
    nvlink_latency_us: float = 5.0
    network_latency_us: float = 15.0
    hbm_gbps: float = 3350.0
    """Device memory bandwidth in GB/s (data sheet): what the step's elementwise kernels, casts and optimizer
    are bound by."""
    hbm_efficiency: float = 0.57
    """Fraction of ``hbm_gbps`` those memory-bound kernels reach. Fitted on one H100: the llama-1b batch-8 trace's
    fused AdamW, casts and fp32 gradient adds (33.8 ms a step for 64 GB moved, 2026-11-26)."""
    fp8_tflops: float = 0.0
    """Dense float8 peak (``precision.float8``); 0 where the GPU has no float8 matmuls (they run at the bf16 rate)."""
    reserved_gb: float = 3.0
    """Memory not available to tensors: CUDA context, NCCL buffers, allocator fragmentation."""
    host_memory_gb: float = 128.0
    """Host memory per GPU in GB that offloaded activations (``train.activation_offload``) may fill: a machine's
    memory over its GPUs, less what the data loader and the process need. 128: one H100 in a 128 GB machine (DGX
    H100: 2 TB over 8 GPUs, 256 each)."""
    pcie_gbps: float = 64.0
    """Host <-> device GB/s per GPU and direction (PCIe Gen5 x16 data sheet; Gen4: 32)."""
    pcie_efficiency: float = 0.8
    """Fraction of ``pcie_gbps`` pinned-memory copies reach."""
    host_step_gbps: float = 10.0
    """GB/s a GPU's share of the host streams through its CPU optimizer step under ``fsdp.cpu_offload`` (AdamW reads
    parameter, gradient and two moments and writes three: 28 bytes per fp32 parameter). An assumption, not
    measured."""

    def with_overrides(self, **values) -> "Hardware":
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM 80GB", 80, 989, 450, 50, 67, hbm_gbps=3350, fp8_tflops=1979),
    "h200": Hardware("H200 SXM 141GB", 141, 989, 450, 50, 67, hbm_gbps=4800, fp8_tflops=1979),
    "a100": Hardware("A100 SXM 80GB", 80, 312, 300, 25, 19.5, hbm_gbps=2039, pcie_gbps=32),
    "a100-40gb": Hardware("A100 SXM 40GB", 40, 312, 300, 25, 19.5, hbm_gbps=1555, pcie_gbps=32),
    "b200": Hardware("B200 180GB", 180, 2250, 900, 100, 80, hbm_gbps=8000, fp8_tflops=4500),
}


def hardware(name: str) -> Hardware:
    key = name.lower()
    if key not in GPUS:
        raise ConfigError(
            f"--gpu: unknown GPU '{name}'; choose one of {', '.join(GPUS)} (and override with --gpu-memory etc.)"
        )
    return GPUS[key]


def parse_gigabytes(text: str) -> float:
    """``80GB``, ``80``, ``141 GB`` -> 80.0 / 141.0 (GB = 1e9 bytes)."""
    cleaned = text.strip().upper().replace(" ", "")
    for suffix in ("GIB", "GB", "G"):
        if cleaned.endswith(suffix):
            number = cleaned[: -len(suffix)]
            factor = 2**30 / 1e9 if suffix == "GIB" else 1.0
            break
    else:
        number, factor = cleaned, 1.0
    try:
        value = float(number) * factor
    except ValueError:
        raise ConfigError(f"--gpu-memory: '{text}' is not a size; write e.g. 80GB") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--gpu-memory: must be positive, got '{text}'")
    return value
