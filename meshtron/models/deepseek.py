"""DeepSeek-V3 (``deepseek_v3``): multi-head latent attention (MLA), dense first layers, shared experts.

MLA projects the hidden states down to two latents, normalizes them and projects them up per head::

    q       = q_b_proj(q_a_layernorm(q_a_proj(x)))           per head: [no-rope part | rope part]
    kv, k_r = kv_a_proj_with_mqa(x)                          the key-value latent, one rope key for all heads
    k, v    = kv_b_proj(kv_a_layernorm(kv))                  per head: [no-rope key part | value]
    key     = [k | rope(k_r)],  query = [q_nope | rope(q_r)]  (qk_nope + qk_rope wide), value v_head_dim wide

so every head has its own key and value (no grouping: ``num_key_value_heads`` = heads) and the values are
narrower than queries and keys. Tensor parallelism splits the per-head up-projections (``q_b_proj`` or
``q_proj``, ``kv_b_proj``) by heads and ``o_proj`` by its input, and computes the down-projections and their
norms whole on every tp rank on the gathered sequence (role ``replicated``): they are small (a latent of
``kv_lora_rank`` + ``qk_rope_head_dim`` and ``q_lora_rank`` features per token). The gradient of the shared rope
key comes from the rank's own heads only, so it is summed over the tp ranks in backward (role ``latent_rope``;
the roles are the family's ``extra_roles`` in meshtron.models.families).

The MoE layers (from ``first_k_dense_replace`` on; the layers before it have a dense MLP) route with sigmoid
scores, top-2 per group, then the top-k of the best ``topk_group`` groups, with the model's own balancing bias
``gate.e_score_correction_bias`` in the choice (which ``moe.router_balance=bias``, the default for this family,
moves; meshtron.train.moe.router_balance), and add the shared experts' dense MLP (``mlp.shared_experts``).
"""

from __future__ import annotations

from meshtron.models.adapter import AttentionShape, DecoderAdapter


class DeepseekAdapter(DecoderAdapter):
    def attention_shape(self, config) -> AttentionShape:
        """Every head has its own key and value; query / key heads are ``qk_nope + qk_rope`` wide, values
        ``v_head_dim``."""
        heads = config.num_attention_heads
        return AttentionShape(
            heads,
            heads,
            config.qk_nope_head_dim + config.qk_rope_head_dim,
            value_head_dim=config.v_head_dim,
            rope_dim=config.qk_rope_head_dim,
        )
