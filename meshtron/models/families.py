"""The model families meshtron maps, and what each cannot do yet.

Every family here but GPT-NeoX has the shared decoder anatomy (``XForCausalLM`` with its body at ``.model``
holding ``embed_tokens``, ``layers`` and ``norm``, its head at ``.lm_head``; GPT-NeoX's own paths are in
``meshtron.models.gpt_neox``); what differs is listed per family: an adapter class of its own where the
family needs one (``adapter``: GPT-NeoX's anatomy, Phi-3's fused projections), tensor-parallel roles of
differently named submodules, transforms the model applies outside its blocks (embedding and logit scaling,
logit soft-capping, which ``DecoderAdapter`` reproduces), and the parallelisms a family cannot be split by,
refused here with one line before any process group starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtron.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """What meshtron knows of one Hugging Face ``model_type`` beyond the shared anatomy."""

    tp_over_kv_heads_refusal: str = ""
    """Why tp cannot exceed the number of KV heads (empty: it can, KV projections are then replicated)."""
    eager_only: str = ""
    """Why the family's attention needs ``model.attn_implementation=eager`` (empty: sdpa works)."""
    zero_centered_norms: bool = False
    """Its RMSNorms scale by ``1 + weight`` (Gemma): fresh norm weights start at 0, not 1."""
    extra_roles: dict[str, str] = field(default_factory=dict)
    """Tensor-parallel roles of block submodules beyond the Llama ones (see ``adapter._BLOCK_TP_ROLES``)."""
    adapter: str = ""
    """Dotted path of the family's adapter class when it is not the shared ``adapter.DecoderAdapter``."""


_GEMMA_NORMS = {"pre_feedforward_layernorm": "norm", "post_feedforward_layernorm": "norm"}
# Per-layer-type masks and rotary embeddings, which its pipeline stages build (meshtron.models.gemma).
_GEMMA_ADAPTER = "meshtron.models.gemma.GemmaAdapter"

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "mistral": Family(),
    # Llama anatomy; embedding_multiplier / logits_scaling are applied by the adapter, the rest by the blocks.
    "granite": Family(),
    # Norms after attention and MLP; q_norm / k_norm normalize over all heads' features at once.
    "olmo2": Family(  # under TP its q/k norms run on the all-gathered heads (GatheredNormParallel)
        extra_roles={
            "post_feedforward_layernorm": "norm",
            "self_attn.q_norm": "gathered_norm",
            "self_attn.k_norm": "gathered_norm",
        },
        tp_over_kv_heads_refusal="its k_norm normalizes over all KV heads together, which tp > KV heads replicates",
    ),
    # Parallel attention and MLP from one LayerNorm; logits multiplied by logit_scale (applied by the adapter).
    "cohere": Family(),
    # Biases everywhere, LayerNorms with biases, a two-matrix MLP.
    "starcoder2": Family(extra_roles={"mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}),
    # Fused qkv_proj and gate_up_proj, trained split (meshtron.models.phi3).
    "phi3": Family(adapter="meshtron.models.phi3.Phi3Adapter"),
    # Body at .gpt_neox (meshtron.models.gpt_neox), biases, LayerNorms, parallel attention and MLP; its fused
    # query_key_value holds each head's q, k and v rows together, so splitting its rows splits by head.
    "gpt_neox": Family(adapter="meshtron.models.gpt_neox.GPTNeoXAdapter"),
    "gemma2": Family(
        adapter=_GEMMA_ADAPTER,
        extra_roles=_GEMMA_NORMS,
        zero_centered_norms=True,
        eager_only="its attention logit soft-capping is not in torch's sdpa",
    ),
    "gemma3_text": Family(adapter=_GEMMA_ADAPTER, extra_roles=_GEMMA_NORMS, zero_centered_norms=True),
    # Mixtures of experts (meshtron.models.moe): a sparse block at mlp (router gate, fused 3-D experts), kept
    # whole on every tp rank ("replicated_block"); checkpoints keep each expert's matrices apart (Mixtral's
    # under block_sparse_moe, w1 / w3 / w2), read into the fused parameters.
    "qwen3_moe": Family(),
    "mixtral": Family(),
    "qwen2_moe": Family(),  # plus a dense shared expert and its sigmoid gate, inside the sparse block
    # OLMoE: Qwen3-MoE's sparse block (64 experts, top-8, no renormalization) with OLMo 2's q/k norms over all
    # heads, but Llama's pre-norms.
    # DeepSeek-V3 (meshtron.models.deepseek): multi-head latent attention, dense first layers, shared experts.
    "deepseek_v3": Family(
        adapter="meshtron.models.deepseek.DeepseekAdapter",
        extra_roles={
            "self_attn.q_a_proj": "replicated",
            "self_attn.q_a_layernorm": "replicated",
            "self_attn.q_b_proj": "colwise",
            "self_attn.kv_a_proj_with_mqa": "latent_rope",
            "self_attn.kv_a_layernorm": "replicated",
            "self_attn.kv_b_proj": "colwise",
        },
    ),
    "olmoe": Family(
        extra_roles={"self_attn.q_norm": "gathered_norm", "self_attn.k_norm": "gathered_norm"},
        tp_over_kv_heads_refusal="its k_norm normalizes over all KV heads together, which tp > KV heads replicates",
    ),
    # gpt-oss (shared DecoderAdapter; docs/models.md): attention with per-head sinks (split with the heads under TP:
    # role attention_sinks, distributed/tp_styles.py) and q/k/v/o biases, sliding and full layers alternating; its
    # sparse block at mlp routes with mlp.router (a bias, softmax over the top-k logits) to transposed, interleaved
    # experts with biases and a clamped SwiGLU (meshtron.models.moe's experts anatomy); checkpoints hold the fused
    # experts as the model does.
    "gpt_oss": Family(
        extra_roles={"self_attn": "attention_sinks"},
        eager_only="its attention sinks are not in torch's sdpa",
    ),
}


def supported_families() -> str:
    return ", ".join(sorted(FAMILIES))


def family_of(hf_config) -> Family:
    """The family of a Hugging Face config, or a one-line ConfigError listing the supported ones."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ConfigError(
            f"model family '{model_type}' is not supported; "
            f"meshtron maps these decoder families: {supported_families()}"
        )
    return FAMILIES[model_type]


def resolve_attn_implementation(setting: str | None, hf_config) -> str | None:
    """``model.attn_implementation`` for this model: ``auto`` is ``eager`` for a family sdpa cannot compute, else
    ``sdpa``; ``sdpa`` and ``eager`` stay what they are."""
    if setting != "auto":
        return setting
    return "eager" if family_of(hf_config).eager_only else "sdpa"


def check_family(hf_config, *, tp: int = 1, attn_implementation: str | None = None) -> None:
    """Refuse an unknown family, or a parallelism the family cannot be split by, with one line."""
    family = family_of(hf_config)
    attn_implementation = resolve_attn_implementation(attn_implementation, hf_config)
    name = hf_config.model_type
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or getattr(hf_config, "num_attention_heads", tp)
    if tp > kv_heads and family.tp_over_kv_heads_refusal:
        raise ConfigError(
            f"model family {name} with parallel.tp={tp} > its {kv_heads} KV heads is not supported yet: "
            f"{family.tp_over_kv_heads_refusal}; use a tp that divides {kv_heads}"
        )
    if attn_implementation == "sdpa" and family.eager_only:
        raise ConfigError(
            f"model family {name} cannot use model.attn_implementation=sdpa: {family.eager_only}; "
            "use model.attn_implementation=eager or auto"
        )
