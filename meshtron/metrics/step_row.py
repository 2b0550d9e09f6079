"""One metrics.jsonl row of an optimizer step (docs/metrics.md): loss, gradient norm, learning rate, throughput, MFU,
peak memory, the fp16 loss scale and the step's other metrics (the MoE router's), as the loop hands it to
meshtron.metrics.step_log.MetricsLogger."""

from __future__ import annotations

import torch

from meshtron.config import LoraConfig, ModelConfig
from meshtron.metrics.flops import device_peak_flops, flops_per_token, lora_flops_per_token_change
from meshtron.metrics.memory import max_memory_gb


class StepRow:
    """The rows of a run of ``hf_config`` (``model``, with ``lora``'s adapters) over sequences of ``seq_len`` on
    ``world_size`` ranks of ``device``'s kind."""

    def __init__(
        self, hf_config, model: ModelConfig, lora: LoraConfig, seq_len: int, device: torch.device, world_size: int
    ):
        self.peak = device_peak_flops(device)
        self.flops_per_token = flops_per_token(hf_config, seq_len) + lora_flops_per_token_change(hf_config, model, lora)
        self.world_size, self.device = world_size, device

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilization at ``tokens_per_s`` over the whole world; None where the peak is unknown (CPUs)."""
        return self.flops_per_token * tokens_per_s / (self.peak * self.world_size) if self.peak else None

    def __call__(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens_per_s: float,
        step_s: float,
        loss_scale: float | None = None,
        metrics: dict | None = None,
    ) -> dict:
        """The row after ``step`` steps; ``loss_scale``: fp16's (none without loss scaling); ``metrics``: the step's
        others."""
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_s": round(step_s, 4),
            "mfu": self.mfu(tokens_per_s),
            "max_memory_gb": max_memory_gb(self.device),
            **({"loss_scale": loss_scale} if loss_scale is not None else {}),
            **(metrics or {}),
        }
