"""The record of one mlx-lm model family whose token mixer is gated delta:
what `patch_mlx_lm` and the property tests know of it, in one place
(`mlx_gated_delta.layers.FAMILIES` lists them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn


@dataclass(frozen=True)
class Family:
    """One mlx-lm model family with gated-delta layers.

    - `name`: mlx-lm's model module, `mlx_lm.models.<name>`.
    - `mlx_lm_class`: the name of that module's gated-delta layer class.
    - `layer`: ours, which `patch_mlx_lm` puts in its place: built from a
      config (`layer(config)`) with the same parameter tree.
    - `config_from_layer`: the config fields `layer` reads, from a built
      mlx-lm layer (which keeps no config; after mlx-lm's `shard` they are
      per rank).
    - `tiny_model(seed, **options)`: a tiny random mlx-lm model of the
      family (mlx-lm's own layers, unpatched), with `tiny_model_layers`
      gated-delta layers and their gate parameters drawn from `seed`; the
      model the property tests run.
    - `tiny_model_variants`: named `options` of `tiny_model`, one per
      setting of the layer the parity tests cover (the first is
      `tiny_model`'s default).
    - `splits_bitwise`: whether that model gives bitwise the same states and
      logits however a prompt is split into calls on the CPU, so that the
      serving tests can compare a trimmed and re-fed cache with a fresh one
      bit for bit there (mlx_gated_delta/tests/test_serving.py).
    """

    name: str
    mlx_lm_class: str
    layer: type[nn.Module]
    config_from_layer: Callable[[nn.Module], Any]
    tiny_model: Callable[..., nn.Module]
    tiny_model_layers: int
    splits_bitwise: bool
    tiny_model_variants: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: {"default": {}}
    )

    def mlx_lm_layer(self) -> type[nn.Module]:
        """mlx-lm's layer class (imports mlx-lm, which the package itself
        does not need)."""
        module = importlib.import_module(f"mlx_lm.models.{self.name}")
        return getattr(module, self.mlx_lm_class)
