"""Model FLOPs per token and device peak FLOP/s, for MFU."""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s per device (no sparsity), from the vendors' data sheets.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of ``device``, or None where it is unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def _mlp_params_per_layer(hf_config) -> list[int]:
    """Weights each token multiplies by in each layer's MLP: the dense MLP, or for a mixture of experts only
    the active ones: top-k routed experts, the router, and a shared expert with its gate (Qwen2-MoE).

    Dense layers of an MoE model (Qwen-MoE's ``mlp_only_layers``, ``decoder_sparse_step``) count as dense.
    """
    from meshtron.models.moe import experts_per_token, num_experts

    hidden, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    dense = 3 * hidden * hf_config.intermediate_size
    experts = num_experts(hf_config)
    if not experts:
        return [dense] * layers
    # Mixtral has no moe_intermediate_size: its intermediate_size is each expert's.
    expert_inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    sparse = experts_per_token(hf_config) * 3 * hidden * expert_inter + hidden * experts
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or 0
    if shared:
        sparse += 3 * hidden * shared + hidden  # the shared expert and its sigmoid gate
    shared_experts = getattr(hf_config, "n_shared_experts", None) or 0  # DeepSeek-V3's, without a gate
    sparse += shared_experts * 3 * hidden * expert_inter
    dense_layers = set(getattr(hf_config, "mlp_only_layers", None) or [])
    dense_layers |= set(range(getattr(hf_config, "first_k_dense_replace", None) or 0))
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    return [sparse if i not in dense_layers and (i + 1) % step == 0 else dense for i in range(layers)]


def flops_per_token(hf_config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding parameters + head) + causal attention (6 x L x 2 x s x d / 2 x 2).

    Counts matmuls only: forward 2 FLOPs per weight per token, backward 4. Attention scores and
    values cost 2 x 2 x s x d per token per layer forward, halved for the causal mask. Mixtures of experts
    count the weights a token is routed through (active parameters), not every expert.
    """
    hidden = hf_config.hidden_size
    layers = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    attn_params, qk_dim, v_dim = _attention_params(hf_config)
    head_params = hidden * hf_config.vocab_size
    matmul_params = layers * attn_params + sum(_mlp_params_per_layer(hf_config)) + head_params
    attention = layers * 2 * seq_len * heads * (qk_dim + v_dim) / 2
    return 6 * matmul_params + 3 * attention


def _attention_params(hf_config) -> tuple[int, int, int]:
    """(matmul weights of one layer's attention, query / key head width, value head width). DeepSeek-V3's latent
    attention: the query's down and up projections (or one q_proj), the key-value latent with the shared rope key,
    its up-projection to every head's no-rope key and value, and o_proj."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    if getattr(hf_config, "kv_lora_rank", None):
        nope, rope, v_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim, hf_config.v_head_dim
        q_rank, kv_rank = getattr(hf_config, "q_lora_rank", None), hf_config.kv_lora_rank
        query = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        latent = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
        return query + latent + heads * v_dim * hidden, nope + rope, v_dim
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return hidden * head_dim * (2 * heads + 2 * kv_heads), head_dim, head_dim


def lora_flops_change(model, adapter, hf_config) -> float:
    """What LoRA changes in ``flops_per_token``, from a model given its adapters (meshtron.models.lora.add_lora; a
    meta model will do): a frozen weight takes no weight gradient (2 of its 6 FLOPs per token skipped), an adapter
    weight adds its 6. Routed experts count their top-k share, as ``flops_per_token`` does; the token embeddings are a
    lookup, not a matmul, unless tied to the head. 0 when every weight trains. The first block's input gradient,
    which autograd also skips with frozen embeddings, is not counted."""
    from meshtron.models.lora import is_lora_parameter
    from meshtron.models.moe import experts_per_token, is_moe, num_experts

    routed = experts_per_token(hf_config) / num_experts(hf_config) if is_moe(hf_config) else 1.0
    embeddings = adapter.embeddings(model).weight
    tied = adapter.lm_head(model).weight is embeddings
    change = 0.0
    for name, param in model.named_parameters():  # a tied head is listed once, as the embeddings
        if param.ndim < 2 or (param is embeddings and not tied):
            continue
        weights = param.numel() * (routed if param.ndim == 3 else 1.0)
        if is_lora_parameter(name):
            change += 6 * weights
        elif not param.requires_grad:
            change -= 2 * weights
    return change


def lora_flops_per_token_change(hf_config, model_cfg, lora) -> float:
    """``lora_flops_change`` of the model ``hf_config`` / ``model_cfg`` make with ``lora``'s adapters (0 without)."""
    if not lora.enabled:
        return 0.0
    import copy

    from meshtron.models.build import build_meta_model
    from meshtron.models.lora import add_lora

    # A copy: building a model sets its attention implementation on the config, which a running model may share.
    model, adapter = build_meta_model(copy.deepcopy(hf_config), model_cfg)
    add_lora(model, adapter, lora)
    return lora_flops_change(model, adapter, hf_config)
