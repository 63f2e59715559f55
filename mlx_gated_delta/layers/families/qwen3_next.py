"""Qwen3-Next: mlx-lm's `qwen3_next.Qwen3NextGatedDeltaNet`, replaced by
`Qwen3NextGatedDeltaNet` (the fused segment)."""

from __future__ import annotations

import mlx.core as mx

from ..family import Family
from ..qwen import Qwen3NextGatedDeltaNet, config_from_layer
from .tiny import LINEAR_HEADS, VOCAB, draw_qwen_gates


def tiny_args(layers=4):
    """The tiny model's `ModelArgs`: hidden 64, a mixture of 4 experts, every
    fourth layer full attention."""
    from mlx_lm.models import qwen3_next

    return qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=512,
        **LINEAR_HEADS,
    )


def tiny_model(seed):
    from mlx_lm.models import qwen3_next

    mx.random.seed(seed)
    return draw_qwen_gates(qwen3_next.Model(tiny_args()))


FAMILY = Family(
    name="qwen3_next",
    mlx_lm_class="Qwen3NextGatedDeltaNet",
    layer=Qwen3NextGatedDeltaNet,
    config_from_layer=config_from_layer,
    tiny_model=tiny_model,
    tiny_model_layers=3,
    splits_bitwise=True,
)
