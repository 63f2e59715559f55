"""Qwen3.5: mlx-lm's `qwen3_5.GatedDeltaNet`, replaced by `Qwen35GatedDeltaNet`
(the fused segment)."""

from __future__ import annotations

import mlx.core as mx

from ..family import Family
from ..qwen import Qwen35GatedDeltaNet, config_from_layer
from .tiny import LINEAR_HEADS, VOCAB, draw_qwen_gates


def tiny_model(seed, layers=4):
    """A tiny random Qwen3.5 model (its text model: every fourth layer full
    attention, the others Gated DeltaNet)."""
    from mlx_lm.models import qwen3_5

    mx.random.seed(seed)
    text = dict(
        model_type="qwen3_5_text",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        **LINEAR_HEADS,
    )
    return draw_qwen_gates(qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text)))


FAMILY = Family(
    name="qwen3_5",
    mlx_lm_class="GatedDeltaNet",
    layer=Qwen35GatedDeltaNet,
    config_from_layer=config_from_layer,
    tiny_model=tiny_model,
    tiny_model_layers=3,
    splits_bitwise=True,
)
