"""Bailing-MoE-V3: mlx-lm's `bailing_moe_v3.BailingKDA`, replaced by
`BailingKDA` (the fused segment, full-rank lower-bounded per-key-channel gates)."""

from __future__ import annotations

import mlx.core as mx

from ..family import Family
from ..kda import BailingKDA, bailing_config
from .tiny import VOCAB, draw_kda_gates


def tiny_model(seed):
    """A tiny random Bailing-MoE-V3 model: layers 0 to 2 Kimi Delta Attention
    (full-rank `f_proj` gates, lower-bounded at -5), layer 3 MLA, layer 0 a
    dense MLP and the others mixtures of experts; A_log and the per head and
    channel dt_bias drawn."""
    from mlx_lm.models import bailing_moe_v3

    mx.random.seed(seed)
    args = bailing_moe_v3.ModelArgs(
        model_type="bailing_moe_v3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        layer_group_size=4,
        head_dim=16,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_lower_bound=-5.0,
        max_position_embeddings=512,
    )
    model = bailing_moe_v3.Model(args)
    return draw_kda_gates(model, [layer.attention for layer in model.layers if layer.is_linear])


FAMILY = Family(
    name="bailing_moe_v3",
    mlx_lm_class="BailingKDA",
    layer=BailingKDA,
    config_from_layer=bailing_config,
    tiny_model=tiny_model,
    tiny_model_layers=3,
    splits_bitwise=True,
)
