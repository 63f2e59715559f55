"""Kimi-Linear: mlx-lm's `kimi_linear.KimiDeltaAttention`, replaced by
`KimiDeltaAttention` (the fused segment, per-key-channel gates)."""

from __future__ import annotations

import mlx.core as mx

from ..family import Family
from ..kda import KimiDeltaAttention, kimi_linear_config
from .tiny import VOCAB, draw_kda_gates


def tiny_model(seed):
    """A tiny random Kimi-Linear model: layers 1, 2 and 4 Kimi Delta
    Attention (per-key-channel gates), layer 3 MLA; A_log and the per head
    and channel dt_bias drawn."""
    from mlx_lm.models import kimi_linear

    mx.random.seed(seed)
    args = kimi_linear.ModelArgs(
        model_type="kimi_linear",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        model_max_length=512,
        num_experts=0,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4],
        },
    )
    model = kimi_linear.Model(args)
    return draw_kda_gates(model, [layer.self_attn for layer in model.layers if layer.is_linear])


FAMILY = Family(
    name="kimi_linear",
    mlx_lm_class="KimiDeltaAttention",
    layer=KimiDeltaAttention,
    config_from_layer=kimi_linear_config,
    tiny_model=tiny_model,
    tiny_model_layers=3,
    # Seen: the conv states after two one-token calls and after one
    # two-token call differ by 3.6e-7, in mlx-lm's own model as in the
    # patched one (MLX's matmuls round differently for another number of
    # rows).
    splits_bitwise=False,
)
