"""What the families' tiny test models share: the vocabulary, the
linear-attention heads, and the draws of the gate parameters that mlx-lm
initializes to constants (ones or zeros), so that a mix-up of heads, of
channels or of value dims shows in the output."""

from __future__ import annotations

import mlx.core as mx

VOCAB = 128

# Qwen3-Next's, Qwen3.5's and OLMo-Hybrid's linear-attention heads: two key
# heads of two value heads each, and Dk != Dv.
LINEAR_HEADS = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def draw_qwen_gates(model):
    """Draws the Qwen layers' dt_bias and gated norm weight; returns the
    model, evaluated."""
    for layer in model.layers:
        if layer.is_linear:
            attn = layer.linear_attn
            attn.dt_bias = mx.random.normal(attn.dt_bias.shape)
            attn.norm.weight = mx.random.uniform(0.5, 1.5, attn.norm.weight.shape)
    mx.eval(model.parameters())
    return model


def draw_kda_gates(model, attentions):
    """Draws the Kimi Delta Attention layers' A_log, dt_bias (per head and
    key channel) and output norm weight; returns the model, evaluated."""
    for attn in attentions:
        attn.A_log = mx.random.normal(attn.A_log.shape)
        attn.dt_bias = 2.0 * mx.random.normal(attn.dt_bias.shape)
        attn.o_norm.weight = mx.random.uniform(0.5, 1.5, attn.o_norm.weight.shape)
    mx.eval(model.parameters())
    return model
