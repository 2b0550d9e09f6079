"""Named from-scratch architectures. Vocabulary size comes from the tokenizer unless a preset fixes it."""

from __future__ import annotations

from typing import Any

from meshtron.errors import ConfigError

# What the DeepSeek-V3 presets share: a dense first layer (DeepSeek-V3 has 3), one shared expert, DeepSeek-V3's routed
# scaling, renormalized top-k and interleaved rope; no special token ids (the byte tokenizer's).
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_interleave=True,
    pad_token_id=None,
    eos_token_id=None,
    bos_token_id=None,
)

# family (HF model_type) and architecture settings; vocab_size None = taken from the tokenizer.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": dict(  # long positions for context-parallel runs (default RoPE allocates nothing for them)
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
    ),
    "qwen2-tiny": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
    "qwen3-tiny": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,  # as Qwen3-0.6B
    ),
    "mistral-tiny": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=None,
    ),
    # Llama anatomy with Granite's four scalings (sizes of granite-3.x, logits_scaling smaller so it matters);
    # untied so that pipeline tests cover the embedding multiplier in a first stage.
    "granite-tiny": dict(
        model_type="granite",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.25,
        logits_scaling=4.0,
    ),
    "olmo2-tiny": dict(  # norms after attention and MLP, q/k norms over all heads
        model_type="olmo2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=None,
        eos_token_id=None,
    ),
    "cohere-tiny": dict(  # parallel attention and MLP, logit_scale (larger than Command-R's 0.0625: tiny logits), tied
        model_type="cohere",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        logit_scale=0.5,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        layer_norm_eps=1e-5,
    ),
    "starcoder2-tiny": dict(  # biases in every linear and LayerNorm, a c_fc / c_proj MLP
        model_type="starcoder2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=None,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "phi3-tiny": dict(  # fused qkv_proj and gate_up_proj
        model_type="phi3",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=None,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "gptneox-tiny": dict(  # body at .gpt_neox, fused per-head qkv, biases, LayerNorms, parallel attention and MLP
        model_type="gpt_neox",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=None,
        eos_token_id=None,
    ),
    # Gemma 2 / 3: scaled embeddings, tied head, a sliding-window layer (window 16 < the tests' 32 tokens)
    # then a global one. Soft-capping caps are far below the real 50 / 30 so that they change the tiny
    # model's (small) attention scores and logits.
    "gemma2-tiny": dict(
        model_type="gemma2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=2048,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
        pad_token_id=0,
    ),
    "gemma3-tiny": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=2048,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
        pad_token_id=0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    # Mixtures of experts (docs/moe.md): 4 experts, top-2, a sparse block in every layer; the router's
    # load-balancing loss off (output_router_logits False) until meshtron's trainer adds it.
    "qwen3moe-tiny": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        norm_topk_prob=True,
        output_router_logits=False,  # as Qwen3-30B-A3B
    ),
    "mixtral-tiny": dict(  # intermediate_size is each expert's
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        sliding_window=None,
        output_router_logits=False,
    ),
    "qwen2moe-tiny": dict(  # a shared expert beside the routed ones, q/k/v biases
        model_type="qwen2_moe",
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        output_router_logits=False,
    ),
    "olmoe-tiny": dict(  # q/k norms over all heads, experts not renormalized (as OLMoE-1B-7B)
        model_type="olmoe",
        hidden_size=64,
        intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        norm_topk_prob=False,
        output_router_logits=False,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    ),
    # DeepSeek-V3 (docs/moe.md): multi-head latent attention (query and key-value latents, rope and no-rope head
    # parts, value heads narrower than query/key heads), a first dense layer, then 8 routed experts in 4 groups
    # (top-2 of 2 groups), one shared expert, sigmoid scores with the model's own balancing bias.
    "deepseekv3-tiny": dict(
        **_DEEPSEEK_V3,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=2048,
    ),
    # A DeepSeek-V3 shape at GPU benchmark size (bench/families.py): 8 layers (the first dense), 64 experts of 512
    # in 8 groups (top-6 of 4 groups), one shared expert, latent attention of 16 heads (~0.8B parameters, ~0.1B
    # active per token).
    "deepseekv3-small": dict(
        **_DEEPSEEK_V3,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=4,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=512,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
    ),
    # Qwen3-30B-A3B shape: 48 layers of 128 experts (768 wide), top-8, 32 query and 4 KV heads of 128, vocab 151936
    # (for --dry-run, --rehearse and meshtron plan of expert parallelism at scale; bench/rehearse_layouts.py).
    "qwen3moe-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        norm_topk_prob=True,
        output_router_logits=False,
        vocab_size=151936,
    ),
    # gpt-oss (docs/models.md): attention sinks, q/k/v/o biases, a sliding layer (window 8 of the tests' 32 tokens)
    # then a full one; 4 transposed experts with biases and a clamped SwiGLU, top-2 by a router with a bias.
    "gptoss-tiny": dict(
        model_type="gpt_oss",
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        output_router_logits=False,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    ),
    "llama-small": dict(
        model_type="llama",
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    # Every dimension divisible by 4 with 4 KV heads: for tensor-parallel measurements up to tp=4.
    "llama-deep": dict(  # many thin layers: enough stages for pipeline tests (8 stages at pp=4, 2 per rank)
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
    "llama-mini": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    # Llama-3.2-1B shape.
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        vocab_size=128256,
    ),
    # Llama-3-8B shape.
    "llama-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        vocab_size=128256,
    ),
    # Llama-3-70B shape.
    "llama-70b": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        vocab_size=128256,
    ),
}
ALIASES = {"tiny": "llama-tiny", "small": "llama-small"}


def preset_names() -> list[str]:
    return sorted(PRESETS) + sorted(ALIASES)


def make_preset_config(name: str, tokenizer_vocab_size: int):
    """Build the Hugging Face config of preset ``name``; the vocab is padded to a multiple of 64."""
    from transformers import AutoConfig

    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset '{name}'; choose one of {', '.join(preset_names())}")
    settings = dict(PRESETS[key])
    model_type = settings.pop("model_type")
    rope_theta = settings.pop("rope_theta", 10000.0)
    if settings.get("vocab_size") is None:
        settings["vocab_size"] = -(-tokenizer_vocab_size // 64) * 64
    settings.setdefault("tie_word_embeddings", False)
    settings.setdefault("initializer_range", 0.02)
    settings.setdefault("rms_norm_eps", 1e-5)
    settings.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    return AutoConfig.for_model(model_type, **settings)
