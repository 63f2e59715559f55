"""The models the demo, the serving benchmark and the soak run: small
Qwen3-Next-shaped mlx-lm models with random weights, built from a config (no
download), stock or patched with `patch_mlx_lm`.
"""

from __future__ import annotations

import mlx.core as mx


def demo_config(layers: int = 4):
    """Qwen3-Next's layer pattern (3 linear-attention layers, then one full
    attention) and head ratios (Hv = 2 Hk, MoE with a shared expert), scaled
    down so that a CPU runs it in seconds."""
    from mlx_lm.models import qwen3_next

    return qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=512,
        num_hidden_layers=layers,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=512,
        mlp_only_layers=[],
        moe_intermediate_size=256,
        rms_norm_eps=1e-6,
        vocab_size=4096,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        full_attention_interval=4,
    )


def build_model(seed: int, layers: int = 4):
    """The model of `demo_config(layers)` with random weights drawn from `seed`,
    mlx-lm's own layers throughout."""
    from mlx_lm.models import qwen3_next

    mx.random.seed(seed)
    model = qwen3_next.Model(demo_config(layers))
    mx.eval(model.parameters())
    return model


def patched_model(seed: int, layers: int = 4):
    """`build_model`'s model with its Gated DeltaNet layers replaced by ours."""
    from mlx_gated_delta import patch_mlx_lm

    model = build_model(seed, layers)
    patch_mlx_lm(model)
    return model


# The projections that write a layer's output into the residual stream.
_OUTPUT_PROJECTIONS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def speculative_models(seed: int, target_layers: int, draft_layers: int, damping: float):
    """The patched target (its layers from `draft_layers` on damped) and the
    patched draft built from the target's embedding, first layers, norm and head."""
    from mlx.utils import tree_flatten

    from mlx_gated_delta import patch_mlx_lm

    target = build_model(seed, target_layers)
    damped = [
        (name, value * damping)
        for name, value in tree_flatten(target.parameters())
        if (_layer_index(name) or 0) >= draft_layers and name.endswith(_OUTPUT_PROJECTIONS)
    ]
    target.load_weights(damped, strict=False)
    draft = build_model(seed + 1, draft_layers)
    draft.load_weights(
        [
            (name, value)
            for name, value in tree_flatten(target.parameters())
            if (_layer_index(name) or 0) < draft_layers
        ]
    )
    mx.eval(target.parameters(), draft.parameters())
    patch_mlx_lm(target)
    patch_mlx_lm(draft)
    return target, draft
