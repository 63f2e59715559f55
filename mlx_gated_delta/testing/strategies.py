"""Inputs for the property tests of the core op, and the Hypothesis profiles.

Hypothesis draws the shape, the options and a seed; NumPy draws the values from
the seed (drawing thousands of floats through Hypothesis would be slow and
would shrink poorly). The values keep the recurrence non-expansive (|k| <= 1
unless the op normalises k; beta in [0, 1], or in [0, 2] as with mlx-lm's
`allow_neg_eigval`: the eigenvalues of I - beta k k^T stay in [-1, 1]), as a
trained model's are, so the numerical contracts measure rounding and not an
input that explodes.

Profiles, chosen by MLX_GATED_DELTA_HYPOTHESIS_PROFILE:
- `ci` (default): the repository's test suite; derandomized, so a run is
  reproducible and a failure is seen again by the next run.
- `selftest`: `python -m mlx_gated_delta selftest`, a small budget.
- `random`: the same properties drawn at random, MLX_GATED_DELTA_EXAMPLES
  examples each (default 500), every costly property included (`budget`);
  pytest's `--hypothesis-seed=N` picks the seed. The properties must hold for
  any draw, not only for those the derandomized profiles make:
  `MLX_GATED_DELTA_HYPOTHESIS_PROFILE=random pytest mlx_gated_delta/tests/test_core.py
  --hypothesis-seed=1`.
"""

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mlx_gated_delta.reference import gated_delta_rule_reference, to_float64
from mlx_gated_delta.testing.contracts import term_magnitudes

PROFILE_ENV = "MLX_GATED_DELTA_HYPOTHESIS_PROFILE"

# No example database: a selftest on a user's machine must not leave a
# .hypothesis directory behind, and derandomized runs do not need it.
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "selftest",
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "random",
    max_examples=int(os.environ.get("MLX_GATED_DELTA_EXAMPLES", "500")),
    deadline=None,
    derandomize=False,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = os.environ.get(PROFILE_ENV, "ci")
settings.load_profile(PROFILE)


def budget(cap):
    """Settings for a costly property: at most `cap` examples in the `ci` and
    `selftest` profiles, the profile's whole budget in `random`, whose point
    is to search further than CI does."""
    examples = settings.default.max_examples
    if PROFILE != "random":
        examples = min(cap, examples)
    return settings(max_examples=examples, deadline=None)


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Token counts around the chunk boundaries of the chunked algorithm (64).
# T == 0 has a property of its own (tests draw it explicitly).
BOUNDARY_TOKENS = (1, 2, 63, 64, 65, 127, 128, 129, 145)
# Small dims, the dims that are not powers of two (80, 96), and the models' 128;
# then dims no vector width divides, and one past the SIMD kernels' 128.
HEAD_DIMS = (16, 32, 64, 80, 96, 128)
ODD_HEAD_DIMS = (1, 3, 17, 130)
# Value heads per key head; 3 makes odd head counts (and, with B = 3, odd
# B * Hv), which split unevenly over the CPU pool's workers.
HEAD_RATIOS = (1, 2, 3, 4)
MAX_BATCH = 3

# Per-token log decays: none, mild, model-like, strong enough that the decay
# across a 64-token chunk underflows float32 (exp(-8 * 64)), and severe: down
# to -300 per token, where exp(g) alone underflows float32 (below about -104)
# or is subnormal (-104 to -87). "mixed" is mostly near-0 decays with a few
# severe ones between them: a chunk whose cumulative log decay is large while
# the decays between neighbouring tokens stay near 1.
DECAY_RANGES = {
    "none": (0.0, 0.0),
    "mild": (-0.1, 0.0),
    "model": (-2.0, 0.0),
    "strong": (-8.0, 0.0),
    "severe": (-300.0, 0.0),
}
DECAY_KINDS = (*DECAY_RANGES, "mixed")
MIXED_SEVERE_FRACTION = 0.15

# Where wipes go (a decay of exactly 0: g = -inf, gamma = 0): nowhere, at
# random tokens, on the first and last token of chunks (t % 64 in {0, 63}),
# in runs of consecutive tokens. A wipe is any g whose exp is 0 in float32,
# g below about -103.97: make_core_case's `wipe_value` sets a finite one.
WIPE_KINDS = ("none", "random", "chunk_edges", "runs")
CHUNK = 64

MASK_KINDS = ("none", "random", "left_padding", "right_padding", "all_true", "all_false")

# Magnitudes of the initial state. "huge" in float16 is bounded by y, which
# must stay finite in float16 (largest 65504): |y| <= |scale| |S| |q| with
# |q| up to about 4 sqrt(Dk); 300 keeps y below about 2e4 for Dk <= 130.
# In float32 and bfloat16 (float32's exponent range) 1e18 keeps every
# product of the recurrence far from float32's largest value.
STATE_SCALES = {"unit": 1.0, "tiny": 1e-30, "huge": 1e18}
HUGE_FLOAT16_STATE = 300.0


@dataclass(repr=False)
class CoreCase:
    """One call of the core op: mlx inputs, the keyword options, and the
    arguments of `make_core_case` that rebuild it (its repr, so a failing
    Hypothesis example can be replayed)."""

    q: mx.array
    k: mx.array
    v: mx.array
    g: mx.array
    beta: mx.array
    state: mx.array | None
    options: dict  # scale, head_mapping, mask, normalize_qk
    recipe: dict

    def args(self):
        return (self.q, self.k, self.v, self.g, self.beta, self.state)

    def reference(self):
        """The oracle's (y, state) on exactly the numbers the op receives."""
        return gated_delta_rule_reference(*self.args(), **self.options)

    def terms(self, algorithm, call_starts=(0,)):
        """The `terms` of `algorithm`'s contracts for this case, run in calls
        starting at `call_starts`: y's `[B, T, Hv, 1]` and the state's after
        each token `[B, T + 1, Hv, 1, 1]` (index 0: the entry state). "auto"
        takes the chunked form's, which bound the recurrent form's."""
        output_terms, state_terms = term_magnitudes(
            *self.args(),
            algorithm=algorithm,
            call_starts=call_starts,
            **self.options,
        )
        return output_terms, state_terms[..., None, None]

    def __repr__(self):
        arguments = ", ".join(f"{name}={value!r}" for name, value in self.recipe.items())
        return f"make_core_case({arguments})"

    def _repr_pretty_(self, printer, cycle):
        # Hypothesis prints examples with its pretty printer, which would
        # otherwise list the arrays field by field.
        printer.text(repr(self))


def make_core_case(
    seed,
    *,
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    dtype="float32",
    gate_dtype="float32",
    decay="model",
    beta_max=1.0,
    with_state=True,
    mask_kind="none",
    normalize_qk=False,
    scale=None,
    head_mapping="grouped",
    wipes="none",
    wipe_value=-np.inf,
    state_scale="unit",
    strided=False,
    per_key_gates=False,
):
    recipe = dict(locals())
    rng = np.random.default_rng(seed)
    B, T = batch, tokens
    activation = DTYPES[dtype]

    q = rng.standard_normal((B, T, key_heads, key_dim))
    if normalize_qk:
        # Raw keys of any size: the op normalises them.
        k = rng.standard_normal((B, T, key_heads, key_dim)) * rng.uniform(0.2, 4.0)
    else:
        # Random directions with norms in [0.25, 0.99]: 1 - beta |k|^2 stays
        # in [-1, 1] for beta <= 2, with a margin for rounding to bfloat16.
        k = rng.standard_normal((B, T, key_heads, key_dim))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        k *= rng.uniform(0.25, 0.99, size=(B, T, key_heads, 1))
    v = rng.standard_normal((B, T, value_heads, value_dim))
    if per_key_gates:
        # One decay per key channel, drawn independently (a "mixed" draw puts
        # severe and near-1 decays on neighbouring channels), wipes on
        # single channels.
        g = make_decays(rng, decay, (B, T, value_heads, key_dim))
        wiped = wipe_positions(rng, wipes, (B, T, value_heads * key_dim))
        g[wiped.reshape(g.shape)] = wipe_value
    else:
        g = make_decays(rng, decay, (B, T, value_heads))
        g[wipe_positions(rng, wipes, (B, T, value_heads))] = wipe_value
    beta = rng.uniform(0.0, beta_max, size=(B, T, value_heads))
    magnitude = STATE_SCALES[state_scale]
    if state_scale == "huge" and dtype == "float16":
        magnitude = HUGE_FLOAT16_STATE
    state = (
        mx.array(
            (rng.standard_normal((B, value_heads, value_dim, key_dim)) * magnitude).astype(
                np.float32
            )
        )
        if with_state
        else None
    )

    options = {"scale": scale, "head_mapping": head_mapping, "normalize_qk": normalize_qk}
    options["mask"] = _make_mask(rng, mask_kind, B, T)

    def to_mx(x, dtype):
        return mx.array(x.astype(np.float32)).astype(dtype)

    gate = DTYPES[gate_dtype]
    arrays = [
        to_mx(q, activation),
        to_mx(k, activation),
        to_mx(v, activation),
        to_mx(g, gate),
        to_mx(beta, gate),
        state,
    ]
    if strided:
        arrays = strided_views(*arrays)
    return CoreCase(*arrays, options=options, recipe=recipe)


def tiny_decay_gamma(case, seed, tiny_fraction, dtype):
    """A linear decay for `gated_delta_update` in `case`'s gate shape: a
    fraction `tiny_fraction` of its decays normal floats but tiny, exp(-87)
    to exp(-8), the rest exp(U(-2, 0)), in `dtype`. Every decay stays a
    normal float, so every chunk runs the chunked backward's WY stages (a
    decay below float32's smallest normal sends its chunk to the recurrent
    reverse): where gamma's gradient would be lost as dg / gamma."""
    rng = np.random.default_rng(seed)
    shape = case.g.shape
    g = np.where(
        rng.uniform(size=shape) < tiny_fraction,
        rng.uniform(-87.0, -8.0, size=shape),
        rng.uniform(-2.0, 0.0, size=shape),
    )
    gamma = mx.exp(mx.array(g.astype(np.float32))).astype(DTYPES[dtype])
    assert np.all(np.asarray(gamma.astype(mx.float32)) >= np.finfo(np.float32).tiny)
    return gamma


def make_decays(rng, kind, shape):
    """Log decays of one of DECAY_KINDS, in float64."""
    if kind == "mixed":
        severe = rng.uniform(size=shape) < MIXED_SEVERE_FRACTION
        return np.where(
            severe,
            rng.uniform(DECAY_RANGES["severe"][0], -8.0, size=shape),
            rng.uniform(-1e-3, 0.0, size=shape),
        )
    low, high = DECAY_RANGES[kind]
    return rng.uniform(low, high, size=shape)


def wipe_positions(rng, kind, shape):
    """A bool array of `shape` ([B, T, H]): True where the decay is a wipe."""
    batch, tokens, heads = shape
    wiped = np.zeros(shape, dtype=bool)
    if kind == "none" or tokens == 0:
        return wiped
    if kind == "random":
        wiped = rng.uniform(size=shape) < 0.05
    elif kind == "chunk_edges":
        # The first or the last token of a chunk (and of the call, when its
        # last chunk is ragged), each head one or the other or neither.
        t = np.arange(tokens)
        first = (t % CHUNK == 0)[None, :, None]
        last = ((t % CHUNK == CHUNK - 1) | (t == tokens - 1))[None, :, None]
        which = rng.integers(0, 3, size=(batch, 1, heads))
        wiped = (first & (which == 0)) | (last & (which == 1))
    elif kind == "runs":
        for b in range(batch):
            for h in range(heads):
                for _ in range(rng.integers(1, 3)):
                    start = rng.integers(0, tokens)
                    wiped[b, start : start + rng.integers(1, 9), h] = True
    else:
        raise ValueError(f"unknown wipe kind {kind!r}")
    return wiped


def strided_views(q, k, v, g, beta, state):
    """Non-contiguous views holding the same values: every other element of
    arrays twice as long in the head dim; the gates and the state read
    through a transpose of arrays stored transposed."""

    def every_other(x):
        return mx.repeat(x, 2, axis=-1)[..., ::2]

    def transposed_view(x, axis1, axis2):
        if x is None:
            return None
        stored_transposed = mx.contiguous(mx.swapaxes(x, axis1, axis2))
        return mx.swapaxes(stored_transposed, axis1, axis2)

    views = [
        every_other(q),
        every_other(k),
        every_other(v),
        transposed_view(g, 1, 2),
        transposed_view(beta, 0, 1),
        transposed_view(state, 2, 3),
    ]
    mx.eval([x for x in views if x is not None])
    return views


def _make_mask(rng, kind, batch, tokens):
    if kind == "none":
        return None
    if kind == "random":
        mask = rng.uniform(size=(batch, tokens)) < 0.7
    elif kind in ("left_padding", "right_padding"):
        # Batched prompts of different lengths, padded on the left (or the
        # right: a batch whose rows end early).
        lengths = rng.integers(0, tokens + 1, size=(batch, 1))
        positions = np.arange(tokens)[None, :]
        if kind == "left_padding":
            mask = positions >= tokens - lengths
        else:
            mask = positions < lengths
    elif kind == "all_true":
        mask = np.ones((batch, tokens), dtype=bool)
    elif kind == "all_false":
        mask = np.zeros((batch, tokens), dtype=bool)
    else:
        raise ValueError(f"unknown mask kind {kind!r}")
    return mx.array(mask)


# The regimes `core_cases` draws from, each a third of the draws: the plain
# case a model makes (an entry state, no wipes, mild decays, several chunks),
# the whole space of options and edges, and a chunk whose keys cover every key
# direction many times (Dk <= 3, no decay, normalised keys) and so contract a
# huge entry state by orders of magnitude (docs/numerics.md).
REGIMES = ("model", "any", "contracting")
MODEL_TOKENS = st.integers(CHUNK + 1, 140)
CONTRACTING_KEY_DIMS = (1, 2, 3)
GRADIENT_KEY_DIMS = tuple(d for d in HEAD_DIMS + ODD_HEAD_DIMS if d > 1)


@st.composite
def core_cases(
    draw,
    dtypes=tuple(DTYPES),
    max_batch=MAX_BATCH,
    tokens=st.one_of(st.sampled_from(BOUNDARY_TOKENS), st.integers(1, 200)),
    with_state=st.booleans(),
    per_key_gates=False,
    several_chunks=True,
    contracting=True,
):
    """A core op call over the shapes and options of docs/contract.md; with
    `per_key_gates`, g has one decay per key channel ([B, T, Hv, Dk]). The
    model regime draws its token count from MODEL_TOKENS where
    `several_chunks`, else from `tokens` as the others do. Without
    `contracting` (the gradients' draws), no huge entry state meets keys that
    can contract it and no normalised key has one dim: the gradients'
    contracts are stated for those calls only (docs/numerics.md)."""
    head_dims = st.one_of(st.sampled_from(HEAD_DIMS), st.sampled_from(ODD_HEAD_DIMS))
    key_heads = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(dtypes))
    regime = draw(st.sampled_from(REGIMES if contracting else REGIMES[:2]))
    options = dict(
        gate_dtype=draw(st.sampled_from(("float32", dtype))),
        beta_max=draw(st.sampled_from((1.0, 2.0))),
        scale=draw(st.sampled_from((None, 0.5, 1.0))),
        head_mapping=draw(st.sampled_from(("grouped", "interleaved"))),
        strided=draw(st.booleans()),
    )
    # Without `contracting`: a huge state only with key dims of 16 and more,
    # and no normalised keys of one dim (the L2 norm of a 1-vector is its
    # sign, whose gradient is 0 up to the norm's eps: pure cancellation).
    normalize_qk = draw(st.booleans())
    key_dims = head_dims if contracting or not normalize_qk else st.sampled_from(GRADIENT_KEY_DIMS)
    if regime == "model":
        options.update(
            tokens=draw(MODEL_TOKENS if several_chunks else tokens),
            key_dim=draw(key_dims),
            decay=draw(st.sampled_from(("mild", "model"))),
            with_state=True,
            mask_kind=draw(st.sampled_from(("none", "all_true", "left_padding"))),
            normalize_qk=normalize_qk,
            wipes="none",
            state_scale="unit",
        )
    elif regime == "contracting":
        options.update(
            tokens=draw(tokens),
            key_dim=draw(st.sampled_from(CONTRACTING_KEY_DIMS)),
            decay="none",
            with_state=True,
            mask_kind=draw(st.sampled_from(("none", "random"))),
            normalize_qk=True,
            wipes="none",
            state_scale="huge",
        )
    else:
        # The gradients' draws in float16 take no huge entry state: y stays
        # within float16's range at HUGE_FLOAT16_STATE, but dk and dq sum
        # beta |S| |dS| over the call's tokens, and their exact values leave
        # it (seen: |dk| 75068 > 65504 at T=63, Dk=32, beta up to 2), where
        # no float16 result can meet a contract. float32 and bfloat16 have
        # float32's exponent range and keep the huge state.
        huge_allowed = contracting or dtype != "float16"
        scales = tuple(scale for scale in STATE_SCALES if huge_allowed or scale != "huge")
        state_scale = draw(st.sampled_from(scales))
        if state_scale == "huge" and not contracting:
            key_dims = st.sampled_from(tuple(d for d in GRADIENT_KEY_DIMS if d >= 16))
        options.update(
            tokens=draw(tokens),
            key_dim=draw(key_dims),
            decay=draw(st.sampled_from(DECAY_KINDS)),
            with_state=draw(with_state),
            mask_kind=draw(st.sampled_from(MASK_KINDS)),
            normalize_qk=normalize_qk,
            wipes=draw(st.sampled_from(WIPE_KINDS)),
            state_scale=state_scale,
        )
    return make_core_case(
        draw(st.integers(0, 2**32 - 1)),
        batch=draw(st.integers(1, max_batch)),
        key_heads=key_heads,
        value_heads=key_heads * draw(st.sampled_from(HEAD_RATIOS)),
        value_dim=draw(head_dims),
        dtype=dtype,
        per_key_gates=per_key_gates,
        **options,
    )


def snapshot(arrays):
    """Float64 copies of mlx arrays (None kept), to check nothing wrote them."""
    return [None if a is None else to_float64(a) for a in arrays]
