"""Drop-in gated-delta layers for mlx-lm's six gated-delta families:
Qwen3-Next and Qwen3.5 (`Qwen3NextGatedDeltaNet`, also named
`GatedDeltaNet`, and `Qwen35GatedDeltaNet`, on the fused segment),
OLMo-Hybrid, Kimi-Linear, Kimi-K3 and Bailing-MoE-V3
(`OlmoHybridGatedDeltaNet`, `KimiDeltaAttention`, `KimiK3DeltaAttention`,
`BailingKDA`: mlx-lm's own projections into the fused segment, their short
convolutions as one). They live in `mlx_gated_delta.layers`, by kind; this module
names them.

Every layer keeps mlx-lm's parameter names and shapes for its family, so
mlx-lm checkpoints (and `model.load_weights`, `nn.quantize`, mlx-lm's
`shard`) see the same module tree as mlx-lm's own layer, and mlx-lm's cache
layout (`ArraysCache`: the conv states, then the state).

`GatedDeltaNet` is an alias of `Qwen3NextGatedDeltaNet`, the name that
layer had while it was the only one: Qwen3-Next's layer, not a generic
one.

On the CPU every layer's plain dense projections run through our blocked
kernel (`dense_projection`) instead of MLX's CPU matmul, which is 10-100x
slower on the machines measured. On a Mac's GPU the segment runs our Metal
kernels.

Training: `mx.grad` and `mlx.nn.value_and_grad` through these layers give
every parameter its gradient (the segment's, the core op's and the
projection kernel's vjps), with no fallback to mlx-lm's per-token loop.

Serving: with a `TrimmableArraysCache` (mlx_gated_delta.cache, what a
patched model's `make_cache` gives), every layer also hands the cache its
slots after the call's last positions (the methods of
`mlx_gated_delta.layers.cache_protocol.LayerCache`), so that speculative
decoding can trim it.
"""

from .layers.cache_protocol import kept_positions, store_in_cache
from .layers.common import GatedRMSNormWeight, dense_projection
from .layers.kda import BailingKDA, KimiDeltaAttention, KimiK3DeltaAttention, kda_log_decay
from .layers.olmo_hybrid import OlmoHybridGatedDeltaNet
from .layers.qwen import GatedDeltaNet, Qwen3NextGatedDeltaNet, Qwen35GatedDeltaNet
from .layers.short_conv import KimiShortConv

__all__ = [
    "BailingKDA",
    "GatedDeltaNet",
    "GatedRMSNormWeight",
    "KimiDeltaAttention",
    "KimiK3DeltaAttention",
    "KimiShortConv",
    "OlmoHybridGatedDeltaNet",
    "Qwen35GatedDeltaNet",
    "Qwen3NextGatedDeltaNet",
    "dense_projection",
    "kda_log_decay",
    "kept_positions",
    "store_in_cache",
]
