"""Swap mlx-lm's Gated DeltaNet layers for ours, in place (docs/contract.md)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.nn as nn

from .nn import GatedDeltaNet, Qwen35GatedDeltaNet, _GatedDeltaNetBase


def _replacements():
    """mlx-lm's layer classes and the class of ours that replaces each."""
    from mlx_lm.models import qwen3_5, qwen3_next

    return {
        qwen3_next.Qwen3NextGatedDeltaNet: GatedDeltaNet,
        qwen3_5.GatedDeltaNet: Qwen35GatedDeltaNet,
    }


def _layer_config(layer: nn.Module) -> SimpleNamespace:
    """The fields our constructor reads, taken from a built mlx-lm layer (it
    does not keep its config; after mlx-lm's `shard` these are per rank)."""
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
    """Replace every Gated DeltaNet layer of an mlx-lm Qwen3-Next or Qwen3.5
    model by ours, in place, keeping its weights; returns how many it replaced.

    Generation then runs the fused segment. The module tree keeps mlx-lm's
    names, so `model.load_weights` after patching reaches the new layers.
    Layers that are already ours are left alone (patching twice replaces 0).
    `model.make_cache()` then gives the gated-delta layers a
    `TrimmableArraysCache` (mlx_gated_delta.cache), so that mlx-lm can trim
    the prompt cache (speculative decoding, `trim_prompt_cache`).

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
                if isinstance(layer, _GatedDeltaNetBase):
                    already_ours += 1
                ours_class = replacements.get(type(layer))
                if ours_class is not None:
                    found.append((parent, key, index, layer, ours_class))
    if not found and not already_ours:
        raise ValueError(
            f"patch_mlx_lm: {type(model).__module__}.{type(model).__name__} has no "
            "Gated DeltaNet layer (mlx-lm's Qwen3NextGatedDeltaNet or "
            "qwen3_5.GatedDeltaNet); nothing to replace"
        )
    for parent, key, index, layer, ours_class in found:
        ours = _swap(layer, ours_class)
        if index is None:
            parent[key] = ours
        else:
            parent[key][index] = ours
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
