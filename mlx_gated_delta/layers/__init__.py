"""Our gated-delta layers for mlx-lm's families, by kind, and the families'
records:

- `qwen`: Qwen3-Next's and Qwen3.5's layers on the fused segment;
- `olmo_hybrid`: OLMo-Hybrid's, on the fused segment;
- `kda`: the Kimi Delta Attention layers (Kimi-Linear's, Kimi-K3's,
  Bailing-MoE-V3's), likewise, with per-key-channel gates;
- `segment_cache`: the fused segment through a cache of one conv state per
  short convolution (OLMo-Hybrid's and the Kimi Delta Attention layers');
- `short_conv`, `common`: the Kimi layers' conv module and what the kinds
  share;
- `cache_protocol`: what a layer asks of its cache;
- `family` and `families`: one record per mlx-lm family (`FAMILIES`), what
  `patch_mlx_lm` and the property tests know of it.

`mlx_gated_delta.nn` is the public face of the layers.
"""

from .families import FAMILIES
from .family import Family

__all__ = ["FAMILIES", "Family"]
