"""Swap mlx-lm's Gated DeltaNet layers for ours, in place (docs/contract.md)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.nn as nn

from .layers.qwen import _GatedDeltaNetBase
from .nn import (
    BailingKDA,
    GatedDeltaNet,
    KimiDeltaAttention,
    KimiK3DeltaAttention,
    OlmoHybridGatedDeltaNet,
    Qwen35GatedDeltaNet,
)

# Our layer classes (a layer of one of these is already patched).
_OURS = (
    _GatedDeltaNetBase,
    OlmoHybridGatedDeltaNet,
    KimiDeltaAttention,
    KimiK3DeltaAttention,
    BailingKDA,
)

# The names of mlx-lm's gated-delta recurrences (mlx_lm.models.gated_delta's
# and MLX's `mx.fast.gated_delta_update`): a module whose own methods call one
# of them is a gated-delta layer.
_RECURRENCE_NAMES = frozenset(("gated_delta_update", "gated_delta_ops", "gated_delta_kernel"))


def _replacements():
    """mlx-lm's layer classes and the class of ours that replaces each."""
    from mlx_lm.models import (
        bailing_moe_v3,
        kimi_k3,
        kimi_linear,
        olmo_hybrid,
        qwen3_5,
        qwen3_next,
    )

    return {
        qwen3_next.Qwen3NextGatedDeltaNet: GatedDeltaNet,
        qwen3_5.GatedDeltaNet: Qwen35GatedDeltaNet,
        olmo_hybrid.GatedDeltaNet: OlmoHybridGatedDeltaNet,
        kimi_linear.KimiDeltaAttention: KimiDeltaAttention,
        kimi_k3.KimiK3DeltaAttention: KimiK3DeltaAttention,
        bailing_moe_v3.BailingKDA: BailingKDA,
    }


def _code_names(code) -> set[str]:
    """The global and attribute names a function's code (and the functions
    and comprehensions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _calls_a_recurrence(cls) -> bool:
    """Whether a module class's own methods (its bases' up to nn.Module
    included) call one of mlx-lm's gated-delta recurrences."""
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            continue
        for value in vars(klass).values():
            # Methods, static and class methods, properties' accessors, and
            # functions under a functools.wraps decorator.
            functions = [value, getattr(value, "__func__", None), getattr(value, "fget", None)]
            functions.append(getattr(value, "__wrapped__", None))
            for function in functions:
                code = getattr(function, "__code__", None)
                if code is not None and _code_names(code) & _RECURRENCE_NAMES:
                    return True
    return False


def _unknown_reason(layer: nn.Module, replacements) -> str | None:
    """Why a module that patch_mlx_lm cannot replace is a gated-delta layer
    (None where it is not one): a subclass of a layer class it knows (which
    may change what the layer computes), or a module that calls mlx-lm's
    gated-delta recurrence itself."""
    cls = type(layer)
    if cls in replacements or isinstance(layer, _OURS):
        return None
    for known in replacements:
        if issubclass(cls, known):
            return f"a subclass of mlx-lm's {known.__module__}.{known.__qualname__}"
    if _calls_a_recurrence(cls):
        return "it calls mlx-lm's gated-delta recurrence"
    return None


def _kimi_linear_config(layer: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=layer.o_proj.weight.shape[0],
        linear_attn_config=dict(
            num_heads=layer.num_heads,
            head_dim=layer.head_dim,
            short_conv_kernel_size=layer.conv_kernel,
        ),
        rms_norm_eps=layer.o_norm.eps,
    )


def _kimi_k3_config(layer: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=layer.o_proj.weight.shape[0],
        linear_attn_config=dict(
            num_heads=layer.num_heads,
            head_dim=layer.head_dim,
            short_conv_kernel_size=layer.conv_kernel,
            gate_lower_bound=layer.lower_bound,
            use_full_rank_gate=layer.use_full_rank_gate,
        ),
        rms_norm_eps=layer.o_norm.eps,
    )


def _bailing_config(layer: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=layer.o_proj.weight.shape[0],
        num_attention_heads=layer.num_heads,
        head_dim=layer.head_dim,
        short_conv_kernel_size=layer.conv_kernel_size,
        kda_lower_bound=layer.lower_bound,
        rms_norm_eps=layer.o_norm.eps,
    )


def _olmo_hybrid_config(layer: nn.Module) -> SimpleNamespace:
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


def _qwen_config(layer: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=layer.hidden_size,
        linear_num_value_heads=layer.num_v_heads,
        linear_num_key_heads=layer.num_k_heads,
        linear_key_head_dim=layer.head_k_dim,
        linear_value_head_dim=layer.head_v_dim,
        linear_conv_kernel_dim=layer.conv_kernel_size,
        rms_norm_eps=layer.layer_norm_epsilon,
    )


# The fields each of our constructors reads, taken from a built mlx-lm layer
# (it does not keep its config; after mlx-lm's `shard` these are per rank).
_CONFIGS = {
    GatedDeltaNet: _qwen_config,
    Qwen35GatedDeltaNet: _qwen_config,
    OlmoHybridGatedDeltaNet: _olmo_hybrid_config,
    KimiDeltaAttention: _kimi_linear_config,
    KimiK3DeltaAttention: _kimi_k3_config,
    BailingKDA: _bailing_config,
}


def _swap(layer: nn.Module, ours_class) -> nn.Module:
    ours = ours_class(_CONFIGS[ours_class](layer))
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
    """Replace every gated-delta layer of an mlx-lm Qwen3-Next, Qwen3.5,
    OLMo-Hybrid, Kimi-Linear, Kimi-K3 or Bailing-MoE-V3 model by ours, in
    place, keeping its weights; returns how many it replaced.

    Generation then runs the fused segment (Qwen3-Next, Qwen3.5) or the core
    op between mlx-lm's projections and convolutions (the other families).
    The module tree keeps mlx-lm's names, so `model.load_weights` after
    patching reaches the new layers. Layers that are already ours are left
    alone (patching twice replaces 0). `model.make_cache()` then gives the
    gated-delta layers a `TrimmableArraysCache` (mlx_gated_delta.cache), with
    the slots of mlx-lm's cache for the family, so that mlx-lm can trim the
    prompt cache (speculative decoding, `trim_prompt_cache`).

    A gated-delta layer of a class it does not know (a subclass of one of
    mlx-lm's layer classes, or any module whose methods call mlx-lm's
    gated-delta recurrence, `gated_delta_update` and the like) is refused:
    it raises, naming each such layer, and replaces nothing, rather than
    patch the model in part.

    Raises:
        ValueError: the model has a gated-delta layer of a class it does not
            know, or no gated-delta layer at all, mlx-lm's or ours.
    """
    replacements = _replacements()
    names = {id(module): name for name, module in model.named_modules()}
    found = []  # (parent, key, index, layer, our class)
    unknown = []  # (name, layer, reason)
    already_ours = 0
    for parent in model.modules():
        items = parent.items() if isinstance(parent, dict) else []
        for key, child in items:
            children = [(i, c) for i, c in enumerate(child)] if isinstance(child, list) else []
            for index, layer in [(None, child)] + children:
                if not isinstance(layer, nn.Module):
                    continue
                if isinstance(layer, _OURS):
                    already_ours += 1
                ours_class = replacements.get(type(layer))
                if ours_class is not None:
                    found.append((parent, key, index, layer, ours_class))
                reason = _unknown_reason(layer, replacements)
                if reason is not None:
                    unknown.append((names.get(id(layer), key), layer, reason))
    if unknown:
        listed = "; ".join(
            f"{name}: {type(layer).__module__}.{type(layer).__qualname__} ({reason})"
            for name, layer, reason in unknown
        )
        raise ValueError(
            f"patch_mlx_lm: {len(unknown)} gated-delta layer(s) of a class it does not "
            f"know: {listed}. It replaces only mlx-lm's own "
            f"{', '.join(_class_name(c) for c in replacements)}; nothing was replaced"
        )
    if not found and not already_ours:
        raise ValueError(
            f"patch_mlx_lm: {type(model).__module__}.{type(model).__name__} has no "
            f"Gated DeltaNet layer (mlx-lm's "
            f"{', '.join(_class_name(c) for c in replacements)}); nothing to replace"
        )
    for parent, key, index, layer, ours_class in found:
        ours = _swap(layer, ours_class)
        if index is None:
            parent[key] = ours
        else:
            parent[key][index] = ours
    _make_caches_trimmable(model)
    return len(found)


def _class_name(cls) -> str:
    """`qwen3_next.Qwen3NextGatedDeltaNet` for mlx-lm's class of that name."""
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}"


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
