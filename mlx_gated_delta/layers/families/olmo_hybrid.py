"""OLMo-Hybrid: mlx-lm's `olmo_hybrid.GatedDeltaNet`, replaced by
`OlmoHybridGatedDeltaNet` (mlx-lm's projections into the fused segment)."""

from __future__ import annotations

import mlx.core as mx

from ..family import Family
from ..olmo_hybrid import OlmoHybridGatedDeltaNet, config_from_layer
from .tiny import LINEAR_HEADS, VOCAB


def tiny_model(seed, allow_neg_eigval=True, layers=4):
    """A tiny random OLMo-Hybrid model (layer 3 full attention, the others
    Gated DeltaNet), with its gate parameters drawn; beta in `[0, 2]` with
    `allow_neg_eigval`."""
    from mlx_lm.models import olmo_hybrid

    mx.random.seed(seed)
    args = olmo_hybrid.ModelArgs(
        model_type="olmo_hybrid",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        linear_allow_neg_eigval=allow_neg_eigval,
        tie_word_embeddings=False,
        attention_bias=False,
        **LINEAR_HEADS,
    )
    model = olmo_hybrid.Model(args)
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            attn = layer.linear_attn
            attn.A_log = mx.random.normal(attn.A_log.shape)
            attn.dt_bias = mx.random.normal(attn.dt_bias.shape)
            attn.o_norm.weight = mx.random.uniform(0.5, 1.5, attn.o_norm.weight.shape)
    mx.eval(model.parameters())
    return model


FAMILY = Family(
    name="olmo_hybrid",
    mlx_lm_class="GatedDeltaNet",
    layer=OlmoHybridGatedDeltaNet,
    config_from_layer=config_from_layer,
    tiny_model=tiny_model,
    tiny_model_layers=3,
    splits_bitwise=True,
    # beta in [0, 2] and in [0, 1]: a layer that dropped the factor 2 (or
    # applied it always) fails one of the two.
    tiny_model_variants={
        "neg_eigval": dict(allow_neg_eigval=True),
        "no_neg_eigval": dict(allow_neg_eigval=False),
    },
)
