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

from mlx_gated_delta.reference import (
    gated_delta_rule_reference,
    gated_delta_segment_reference,
    segment_core_inputs,
    to_float64,
)
from mlx_gated_delta.testing.contracts import term_magnitudes
from mlx_gated_delta.testing.strategies import (
    BOUNDARY_TOKENS,
    DTYPES,
    MASK_KINDS,
    WIPE_KINDS,
    _make_mask,
    make_decays,
    wipe_positions,
)

# The segment's decays come from its decay input a: g = rate * softplus(a +
# dt_bias). "model" keeps a as drawn (O(1), like the rest of the projection);
# the other kinds set a so that g follows `strategies.make_decays`, and a wipe
# is a = +inf (softplus(inf) = inf, g = -inf).
SEGMENT_DECAY_KINDS = ("model", "mild", "severe", "mixed")
# The state's magnitudes: the gated RMS norm makes out independent of the
# scale of y, but it sums y^2 in float32, so "huge" keeps y^2 summed over a
# head (|y| about 1e16) below float32's largest value (3.4e38).
SEGMENT_STATE_SCALES = {"unit": 0.5, "tiny": 1e-30, "huge": 1e15}
# The gated norm's epsilon, the segment's default (docs/contract.md).
NORM_EPS = 1e-6
# The gate variants' option values (`gate_variant_options`): the lower
# bounds are those of the mlx-lm families' configs' range.
LOWER_BOUNDS = (-5.0, -1.0)
OUTPUT_GATES = ("silu", "sigmoid")


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

    def terms(self, algorithm, call_starts=(0,)):
        """`segment_terms` of this case: (out's, the final state's)."""
        return segment_terms(
            *self.args(), algorithm=algorithm, call_starts=call_starts, **self.options
        )

    def __repr__(self):
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.recipe.items())
        return f"make_segment_case({arguments})"


def segment_terms(
    mixed,
    conv_weight,
    decay_parameter,
    dt_bias,
    norm_weight,
    conv_state=None,
    state=None,
    *,
    algorithm,
    call_starts=(0,),
    **options,
):
    """The `terms` of `algorithm`'s segment contracts, for a segment call (the
    arguments and options of `gated_delta_segment_reference`) run in calls
    starting at `call_starts`: out's `[B, T, Hv, Dv]` and the final state's
    `[B, Hv, 1, 1]`.

    The state is the core's: its terms are the core's (`term_magnitudes`),
    the states from the entry of each step or chunk on, which a call that
    contracts a huge entry state (keys spanning their few dims many times,
    or strong decays) leaves far above the result.

    out = rms_norm(y) norm_weight o(z) per token and value head (o the
    output gate, silu or sigmoid). An error of y within the core's contract
    (against y's terms) moves out_i by at most |norm_weight o(z)|_i (1 +
    |y_i| / r) max|dy| / r, r = rms(y): where y cancels (a token whose q and
    the state nearly miss each other), the norm scales its error up with it
    (docs/numerics.md)."""
    sigmoid_gate = options.pop("output_gate", "silu") == "sigmoid"
    core = segment_core_inputs(mixed, conv_weight, decay_parameter, dt_bias, conv_state, **options)
    y_terms, state_terms = term_magnitudes(
        *core.arrays,
        state,
        algorithm=algorithm,
        call_starts=call_starts,
        **core.options,
    )
    y, _ = gated_delta_rule_reference(*core.arrays, state, **core.options)
    rms = np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + NORM_EPS)
    z = core.x[..., core.layout.z_offset : core.layout.b_offset].reshape(y.shape)
    gate = 1.0 / (1.0 + np.exp(-z)) if sigmoid_gate else z / (1.0 + np.exp(-z))
    output_gate = np.abs(to_float64(norm_weight) * gate)
    out_terms = output_gate * (1.0 + np.abs(y) / rms) * y_terms / rms
    return out_terms, state_terms[:, -1, :, None, None]


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
    decay="model",
    wipes="none",
    state_scale="unit",
    strided=False,
    per_key_gates=False,
    lower_bound=None,
    allow_neg_eigval=False,
    output_gate="silu",
):
    recipe = dict(locals())
    rng = np.random.default_rng(seed)
    activation = DTYPES[dtype]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    gate_width = value_heads * key_dim if per_key_gates else value_heads
    width = channels + value_heads * value_dim + value_heads + gate_width

    def to_mx(x, dtype=mx.float32):
        return mx.array(np.asarray(x, dtype=np.float32)).astype(dtype)

    weight_shape = (channels, conv_kernel, 1) if conv1d_layout else (channels, conv_kernel)
    if decay_parameterization == "log_rate":
        decay_parameter = rng.uniform(-2.0, 1.5, size=value_heads)  # A_log
    else:
        decay_parameter = -rng.uniform(0.05, 4.0, size=value_heads)  # the rate
    mask = _make_mask(rng, mask_kind, batch, tokens)

    mixed = rng.standard_normal((batch, tokens, width))
    dt_bias = rng.standard_normal(gate_width)
    rate = -np.exp(decay_parameter) if decay_parameterization == "log_rate" else decay_parameter
    rate = np.repeat(rate, gate_width // value_heads)  # per column of a
    a = mixed[..., width - gate_width :]  # the last columns: a
    if decay != "model" and lower_bound is not None:
        # g = lower_bound sigmoid(-rate u): u = logit(g / lower_bound) / -rate,
        # the decays past the bound clipped to it.
        fraction = np.clip(make_decays(rng, decay, a.shape) / lower_bound, 1e-12, 1.0 - 1e-12)
        a[...] = (np.log(fraction) - np.log1p(-fraction)) / -rate - dt_bias
    elif decay != "model":
        # softplus(a + dt_bias) = g / rate; softplus^-1(x) = log(expm1(x)),
        # written x + log1p(-exp(-x)) above 1 (no overflow), with x kept
        # above 1e-30 (a decay of exactly 1 would need a = -inf).
        target = np.maximum(make_decays(rng, decay, a.shape) / rate, 1e-30)
        large = np.maximum(target, 1.0)
        inverse = np.where(
            target > 1.0,
            large + np.log1p(-np.exp(-large)),
            np.log(np.expm1(np.minimum(target, 1.0))),
        )
        a[...] = inverse - dt_bias
    a[wipe_positions(rng, wipes, a.shape)] = np.inf

    # Drawn whether used or not, so that a case and its copy without a state
    # draw the same numbers for everything else.
    state = rng.standard_normal((batch, value_heads, value_dim, key_dim))
    state = to_mx(state * SEGMENT_STATE_SCALES[state_scale]) if with_state else None
    mixed = to_mx(mixed, activation)
    if strided:
        # Every other element of an array twice as wide; the state read
        # through a transpose of an array stored transposed.
        mixed = mx.repeat(mixed, 2, axis=-1)[..., ::2]
        if state is not None:
            state = mx.swapaxes(mx.contiguous(mx.swapaxes(state, 2, 3)), 2, 3)
        mx.eval([x for x in (mixed, state) if x is not None])

    return SegmentCase(
        mixed=mixed,
        conv_weight=to_mx(rng.normal(0.0, 0.5, size=weight_shape)),
        decay_parameter=to_mx(decay_parameter),
        dt_bias=to_mx(dt_bias.reshape(value_heads, key_dim) if per_key_gates else dt_bias),
        norm_weight=to_mx(rng.uniform(0.5, 1.5, size=value_dim)),
        conv_state=(
            to_mx(rng.standard_normal((batch, conv_kernel - 1, channels)), activation)
            if with_conv_state
            else None
        ),
        state=state,
        options=dict(
            key_heads=key_heads,
            value_heads=value_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            decay_parameterization=decay_parameterization,
            head_mapping=head_mapping,
            mask=mask,
            **gate_options(lower_bound, allow_neg_eigval, output_gate),
        ),
        recipe=recipe,
    )


def gate_options(lower_bound=None, allow_neg_eigval=False, output_gate="silu"):
    """The segment's gate keywords that differ from their defaults (the
    Qwen layout's), so that a case without variants has the options it
    always had."""
    options = dict(
        lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval, output_gate=output_gate
    )
    defaults = dict(lower_bound=None, allow_neg_eigval=False, output_gate="silu")
    return {name: value for name, value in options.items() if value != defaults[name]}


@st.composite
def gate_variant_options(draw, variants=True):
    """The recipe's gate options: the Qwen layout's, or (with `variants`)
    any mix of per-key gates, a lower bound, beta in [0, 2] and a sigmoid
    output gate."""
    if not variants or not draw(st.booleans()):
        return {}
    return dict(
        per_key_gates=draw(st.booleans()),
        lower_bound=draw(st.sampled_from((None, *LOWER_BOUNDS))),
        allow_neg_eigval=draw(st.booleans()),
        output_gate=draw(st.sampled_from(OUTPUT_GATES)),
    )


@st.composite
def segment_cases(
    draw,
    dtypes=tuple(DTYPES),
    tokens=st.one_of(st.sampled_from(BOUNDARY_TOKENS), st.integers(0, 100)),
    mask_kinds=MASK_KINDS,
    variants=True,
):
    """A segment call over the shapes and options of docs/contract.md;
    `variants` draws the gate options too."""
    gates = draw(gate_variant_options(variants))
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
        decay=draw(st.sampled_from(SEGMENT_DECAY_KINDS)),
        wipes=draw(st.sampled_from(WIPE_KINDS)),
        state_scale=draw(st.sampled_from(tuple(SEGMENT_STATE_SCALES))),
        strided=draw(st.booleans()),
        **gates,
    )
