"""Kimi-K3: mlx-lm's `kimi_k3.KimiK3DeltaAttention`, replaced by
`KimiK3DeltaAttention` (the fused segment, per-key-channel gates, lower-bounded
where the model sets `gate_lower_bound`)."""

from __future__ import annotations

import mlx.core as mx

from ..family import Family
from ..kda import KimiK3DeltaAttention, kimi_k3_config
from .tiny import VOCAB, draw_kda_gates


def tiny_model(seed, lower_bound=-5.0, full_rank_gate=False):
    """A tiny random Kimi-K3 model: layers 1, 2 and 4 Kimi Delta Attention
    (one q|k|v projection and convolution, per-key-channel gates,
    lower-bounded unless `lower_bound` is None), layer 3 MLA; A_log and the
    per head and channel dt_bias drawn."""
    from mlx_lm.models import kimi_k3

    mx.random.seed(seed)
    linear = {
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "use_full_rank_gate": full_rank_gate,
    }
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    text = dict(
        model_type="kimi_k3",
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        linear_attn_config=linear,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=0,
    )
    model = kimi_k3.Model(kimi_k3.ModelArgs(model_type="kimi_k3", text_config=text))
    return draw_kda_gates(model, [layer.self_attn for layer in model.layers if layer.is_linear])


FAMILY = Family(
    name="kimi_k3",
    mlx_lm_class="KimiK3DeltaAttention",
    layer=KimiK3DeltaAttention,
    config_from_layer=kimi_k3_config,
    tiny_model=tiny_model,
    tiny_model_layers=3,
    # As Kimi-Linear's: its conv states depend, by rounding, on how the
    # tokens were split into calls, stock and patched alike.
    splits_bitwise=False,
    # With and without gate_lower_bound: a layer that ignored it (or always
    # applied it) fails one of the cases.
    tiny_model_variants={
        "lower_bound": dict(lower_bound=-5.0),
        "no_lower_bound": dict(lower_bound=None),
        "full_rank_gate": dict(lower_bound=-3.0, full_rank_gate=True),
    },
)
