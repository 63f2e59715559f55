"""Swap mlx-lm's Gated DeltaNet layers for ours, in place (docs/contract.md)."""

from __future__ import annotations

import mlx.nn as nn

from .layers import FAMILIES, Family

# Our layer classes (a layer of one of these is already patched).
_OURS = tuple(family.layer for family in FAMILIES)

# The names of mlx-lm's gated-delta recurrences (mlx_lm.models.gated_delta's
# and MLX's `mx.fast.gated_delta_update`): a module whose own methods call one
# of them is a gated-delta layer.
_RECURRENCE_NAMES = frozenset(("gated_delta_update", "gated_delta_ops", "gated_delta_kernel"))


class NoGatedDeltaLayer(ValueError):
    """What `patch_mlx_lm` raises for a model without any gated-delta layer
    (a `ValueError`, as documented), told apart from a layer it refuses so
    that a caller patching every model it loads can run such a model as it
    is."""


def _replacements() -> dict[type, Family]:
    """mlx-lm's layer classes and the family record of each (whose `layer`
    replaces it), in the order of FAMILIES."""
    return {family.mlx_lm_layer(): family for family in FAMILIES}


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


def _swap(layer: nn.Module, family: Family) -> nn.Module:
    ours = family.layer(family.config_from_layer(layer))
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
    OLMo-Hybrid, Kimi-Linear, Kimi-K3 or Bailing-MoE-V3 model (the records
    of `mlx_gated_delta.layers.FAMILIES`) by ours, in place, keeping its
    weights; returns how many it replaced.

    Generation then runs the fused segment after the projections, in every
    family.
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
            know, or no gated-delta layer at all, mlx-lm's or ours (then a
            `NoGatedDeltaLayer`, a subclass).
    """
    replacements = _replacements()
    names = {id(module): name for name, module in model.named_modules()}
    found = []  # (parent, key, index, layer, family)
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
                family = replacements.get(type(layer))
                if family is not None:
                    found.append((parent, key, index, layer, family))
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
        raise NoGatedDeltaLayer(
            f"patch_mlx_lm: {type(model).__module__}.{type(model).__name__} has no "
            f"Gated DeltaNet layer (mlx-lm's "
            f"{', '.join(_class_name(c) for c in replacements)}); nothing to replace"
        )
    for parent, key, index, layer, family in found:
        ours = _swap(layer, family)
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
