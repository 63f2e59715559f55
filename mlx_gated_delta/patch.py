"""Swap mlx-lm's Gated DeltaNet layers for ours, in place (docs/contract.md)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.nn as nn

from .nn import (
    GatedDeltaNet,
    KimiDeltaAttention,
    OlmoHybridGatedDeltaNet,
    Qwen35GatedDeltaNet,
    _GatedDeltaNetBase,
)

# Our layer classes (a layer of one of these is already patched).
_OURS = (_GatedDeltaNetBase, OlmoHybridGatedDeltaNet, KimiDeltaAttention)


def _replacements():
    """mlx-lm's layer classes and the class of ours that replaces each."""
    from mlx_lm.models import kimi_linear, olmo_hybrid, qwen3_5, qwen3_next

    return {
        qwen3_next.Qwen3NextGatedDeltaNet: GatedDeltaNet,
        qwen3_5.GatedDeltaNet: Qwen35GatedDeltaNet,
        olmo_hybrid.GatedDeltaNet: OlmoHybridGatedDeltaNet,
        kimi_linear.KimiDeltaAttention: KimiDeltaAttention,
    }


def _layer_config(layer: nn.Module) -> SimpleNamespace:
    """The fields our constructor reads, taken from a built mlx-lm layer (it
    does not keep its config; after mlx-lm's `shard` these are per rank)."""
    if hasattr(layer, "f_a_proj"):  # Kimi-Linear's layer
        return SimpleNamespace(
            hidden_size=layer.o_proj.weight.shape[0],
            linear_attn_config=dict(
                num_heads=layer.num_heads,
                head_dim=layer.head_dim,
                short_conv_kernel_size=layer.conv_kernel,
            ),
            rms_norm_eps=layer.o_norm.eps,
        )
    if hasattr(layer, "o_norm"):  # OLMo-Hybrid's layer
        return SimpleNamespace(
            # o_proj's output dim: quantization packs only the input dim.
            hidden_size=layer.o_proj.weight.shape[0],
            linear_num_value_heads=layer.num_v_heads,
            linear_num_key_heads=layer.num_k_heads,
            linear_key_head_dim=layer.head_k_dim,
            linear_value_head_dim=layer.head_v_dim,
            linear_conv_kernel_dim=layer.conv_kernel_size,
            linear_allow_neg_eigval=layer.allow_neg_eigval,
            layer_norm_epsilon=layer.o_norm.eps,
        )
    return SimpleNamespace(
        hidden_size=layer.hidden_size,
        linear_num_value_heads=layer.num_v_heads,
        linear_num_key_heads=layer.num_k_heads,
        linear_key_head_dim=layer.head_k_dim,
        linear_value_head_dim=layer.head_v_dim,
        linear_conv_kernel_dim=layer.conv_kernel_size,
        rms_norm_eps=layer.layer_norm_epsilon,
    )


def _swap(layer: nn.Module, ours_class) -> nn.Module:
    ours = ours_class(_layer_config(layer))
    # Take over mlx-lm's own children and parameters (plain or quantized, the
    # same arrays, nothing copied), so the module tree is unchanged.
    for name in list(ours.keys()):
        del ours[name]
    for name, value in layer.items():
        ours[name] = value
    if hasattr(layer, "sharding_group"):
        ours.sharding_group = layer.sharding_group
    ours.train(layer.training)
    return ours


def patch_mlx_lm(model: nn.Module) -> int:
    """Replace every Gated DeltaNet layer of an mlx-lm Qwen3-Next, Qwen3.5,
    OLMo-Hybrid or Kimi-Linear model by ours, in place, keeping its weights; returns how many it replaced.

    Generation then runs the fused segment (OLMo-Hybrid's layer: the core
    op between mlx-lm's projections and convolutions). The module tree keeps mlx-lm's
    names, so `model.load_weights` after patching reaches the new layers.
    Layers that are already ours are left alone (patching twice replaces 0).
    For Qwen3-Next and Qwen3.5, `model.make_cache()` then gives the
    gated-delta layers a `TrimmableArraysCache` (mlx_gated_delta.cache), so
    that mlx-lm can trim the prompt cache (speculative decoding,
    `trim_prompt_cache`); OLMo-Hybrid's and Kimi-Linear's layers keep
    mlx-lm's cache.

    Raises:
        ValueError: the model has no Gated DeltaNet layer, mlx-lm's or ours.
    """
    replacements = _replacements()
    found = []  # (parent, key, layer, our class)
    already_ours = 0
    for parent in model.modules():
        items = parent.items() if isinstance(parent, dict) else []
        for key, child in items:
            children = [(i, c) for i, c in enumerate(child)] if isinstance(child, list) else []
            for index, layer in [(None, child)] + children:
                if isinstance(layer, _OURS):
                    already_ours += 1
                ours_class = replacements.get(type(layer))
                if ours_class is not None:
                    found.append((parent, key, index, layer, ours_class))
    if not found and not already_ours:
        raise ValueError(
            f"patch_mlx_lm: {type(model).__module__}.{type(model).__name__} has no "
            "Gated DeltaNet layer (mlx-lm's Qwen3NextGatedDeltaNet, "
            "qwen3_5.GatedDeltaNet, olmo_hybrid.GatedDeltaNet or "
            "kimi_linear.KimiDeltaAttention); nothing to replace"
        )
    for parent, key, index, layer, ours_class in found:
        ours = _swap(layer, ours_class)
        if index is None:
            parent[key] = ours
        else:
            parent[key][index] = ours
    # The trimmable cache keeps the states that the fused segment returns as
    # checkpoints: OLMo-Hybrid's and Kimi-Linear's layers run the core op
    # between mlx-lm's convolutions, with their own cache layout, and keep
    # mlx-lm's ArraysCache (not trimmable, as before patching).
    if any(isinstance(m, _GatedDeltaNetBase) for m in model.modules()):
        _make_caches_trimmable(model)
    return len(found)


def _make_caches_trimmable(model: nn.Module) -> None:
    """Wraps the model's `make_cache` (once) so that its gated-delta layers
    get a TrimmableArraysCache instead of mlx-lm's ArraysCache."""
    from .cache import trimmable_cache

    make_cache = getattr(model, "make_cache", None)
    if make_cache is None or getattr(make_cache, "_gated_delta_trimmable", False):
        return

    def make_trimmable_cache():
        return trimmable_cache(make_cache())

    make_trimmable_cache._gated_delta_trimmable = True
    # An instance attribute: mlx-lm's make_prompt_cache calls model.make_cache().
    object.__setattr__(model, "make_cache", make_trimmable_cache)
