"""The records of the mlx-lm families with gated-delta layers, one module
each (a `FAMILY`: mlx-lm's layer class, ours, the config from a built layer,
the tiny test model). `patch_mlx_lm` replaces the families of `FAMILIES`, in
this order, and the layer and serving property tests run on each; a family
is added with its module and its entry here."""

from . import bailing_moe_v3, kimi_k3, kimi_linear, olmo_hybrid, qwen3_5, qwen3_next

FAMILIES = (
    qwen3_next.FAMILY,
    qwen3_5.FAMILY,
    olmo_hybrid.FAMILY,
    kimi_linear.FAMILY,
    kimi_k3.FAMILY,
    bailing_moe_v3.FAMILY,
)
