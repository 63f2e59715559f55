"""Inputs for the property tests of the fused layer segment (docs/contract.md).

Like `strategies.py` (whose Hypothesis profiles load with this module),
Hypothesis draws the shape, the options and a seed, and NumPy draws the
values. Values are of the size a trained model's are: the packed projection
and the conv state O(1), a conv kernel of O(0.5) taps, rates that give
per-token decays from about 0.9 to strong forgetting, a recurrent state O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from mlx_gated_delta.reference import gated_delta_segment_reference
from mlx_gated_delta.testing.strategies import BOUNDARY_TOKENS, DTYPES


@dataclass(repr=False)
class SegmentCase:
    """One segment call: mlx inputs, keyword options and the recipe that
    rebuilds it (its repr, so a failing Hypothesis example can be replayed)."""

    mixed: mx.array
    conv_weight: mx.array
    decay_parameter: mx.array
    dt_bias: mx.array
    norm_weight: mx.array
    conv_state: mx.array | None
    state: mx.array | None
    options: dict  # heads, dims, decay_parameterization, head_mapping, mask
    recipe: dict

    def args(self):
        return (
            self.mixed,
            self.conv_weight,
            self.decay_parameter,
            self.dt_bias,
            self.norm_weight,
            self.conv_state,
            self.state,
        )

    def reference(self):
        """The oracle's (out, conv_state, state) on exactly these numbers."""
        return gated_delta_segment_reference(*self.args(), **self.options)

    def __repr__(self):
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.recipe.items())
        return f"make_segment_case({arguments})"


def make_segment_case(
    seed,
    *,
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    conv_kernel=4,
    dtype="float32",
    decay_parameterization="log_rate",
    head_mapping="grouped",
    with_conv_state=True,
    with_state=True,
    mask_kind="none",
    conv1d_layout=False,
):
    recipe = dict(locals())
    rng = np.random.default_rng(seed)
    activation = DTYPES[dtype]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    width = channels + value_heads * value_dim + 2 * value_heads

    def to_mx(x, dtype=mx.float32):
        return mx.array(np.asarray(x, dtype=np.float32)).astype(dtype)

    weight_shape = (channels, conv_kernel, 1) if conv1d_layout else (channels, conv_kernel)
    if decay_parameterization == "log_rate":
        decay_parameter = rng.uniform(-2.0, 1.5, size=value_heads)  # A_log
    else:
        decay_parameter = -rng.uniform(0.05, 4.0, size=value_heads)  # the rate
    mask = None
    if mask_kind == "random":
        mask = mx.array(rng.uniform(size=(batch, tokens)) < 0.7)
    elif mask_kind == "left_padding":
        starts = rng.integers(0, tokens + 1, size=(batch, 1))
        mask = mx.array(np.arange(tokens)[None, :] >= starts)
    elif mask_kind != "none":
        raise ValueError(f"unknown mask kind {mask_kind!r}")

    return SegmentCase(
        mixed=to_mx(rng.standard_normal((batch, tokens, width)), activation),
        conv_weight=to_mx(rng.normal(0.0, 0.5, size=weight_shape)),
        decay_parameter=to_mx(decay_parameter),
        dt_bias=to_mx(rng.standard_normal(value_heads)),
        norm_weight=to_mx(rng.uniform(0.5, 1.5, size=value_dim)),
        conv_state=(
            to_mx(rng.standard_normal((batch, conv_kernel - 1, channels)), activation)
            if with_conv_state
            else None
        ),
        state=(
            to_mx(rng.standard_normal((batch, value_heads, value_dim, key_dim)) * 0.5)
            if with_state
            else None
        ),
        options=dict(
            key_heads=key_heads,
            value_heads=value_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            decay_parameterization=decay_parameterization,
            head_mapping=head_mapping,
            mask=mask,
        ),
        recipe=recipe,
    )


@st.composite
def segment_cases(
    draw,
    dtypes=tuple(DTYPES),
    tokens=st.one_of(st.sampled_from(BOUNDARY_TOKENS), st.integers(0, 100)),
    mask_kinds=("none", "random", "left_padding"),
):
    """A segment call over the shapes and options of docs/contract.md."""
    key_heads = draw(st.integers(1, 2))
    return make_segment_case(
        draw(st.integers(0, 2**32 - 1)),
        batch=draw(st.integers(1, 2)),
        tokens=draw(tokens),
        key_heads=key_heads,
        value_heads=key_heads * draw(st.sampled_from((1, 2, 4))),
        key_dim=draw(st.sampled_from((8, 16, 32))),
        value_dim=draw(st.sampled_from((8, 16, 24))),
        conv_kernel=draw(st.sampled_from((1, 2, 4))),
        dtype=draw(st.sampled_from(dtypes)),
        decay_parameterization=draw(st.sampled_from(("log_rate", "negative_rate"))),
        head_mapping=draw(st.sampled_from(("grouped", "interleaved"))),
        with_conv_state=draw(st.booleans()),
        with_state=draw(st.booleans()),
        mask_kind=draw(st.sampled_from(mask_kinds)),
        conv1d_layout=draw(st.booleans()),
    )
