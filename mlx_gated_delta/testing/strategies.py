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
"""

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mlx_gated_delta.reference import gated_delta_rule_reference, to_float64

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
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Token counts around the chunk boundaries of the chunked algorithm (64).
# T == 0 has a property of its own (tests draw it explicitly).
BOUNDARY_TOKENS = (1, 2, 63, 64, 65, 127, 128, 129, 145)
# Small dims, the dims that are not powers of two (80, 96), and the models' 128;
# then dims no vector width divides, and one past the SIMD kernels' 128.
HEAD_DIMS = (16, 32, 64, 80, 96, 128)
ODD_HEAD_DIMS = (1, 3, 17, 130)
HEAD_RATIOS = (1, 2, 4)

# Per-token log decays: none, mild, model-like, and strong enough that the
# decay across a 64-token chunk underflows float32 (exp(-8 * 64)).
DECAY_RANGES = {"none": (0.0, 0.0), "mild": (-0.1, 0.0), "model": (-2.0, 0.0), "strong": (-8.0, 0.0)}


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
    low, high = DECAY_RANGES[decay]
    g = rng.uniform(low, high, size=(B, T, value_heads))
    beta = rng.uniform(0.0, beta_max, size=(B, T, value_heads))
    state = (
        mx.array(rng.standard_normal((B, value_heads, value_dim, key_dim)).astype(np.float32))
        if with_state
        else None
    )

    options = {"scale": scale, "head_mapping": head_mapping, "normalize_qk": normalize_qk}
    options["mask"] = _make_mask(rng, mask_kind, B, T)

    def to_mx(x, dtype):
        return mx.array(x.astype(np.float32)).astype(dtype)

    gate = DTYPES[gate_dtype]
    return CoreCase(
        q=to_mx(q, activation),
        k=to_mx(k, activation),
        v=to_mx(v, activation),
        g=to_mx(g, gate),
        beta=to_mx(beta, gate),
        state=state,
        options=options,
        recipe=recipe,
    )


def _make_mask(rng, kind, batch, tokens):
    if kind == "none":
        return None
    if kind == "random":
        mask = rng.uniform(size=(batch, tokens)) < 0.7
    elif kind == "left_padding":
        # Batched prompts of different lengths, padded on the left.
        starts = rng.integers(0, tokens + 1, size=(batch, 1))
        mask = np.arange(tokens)[None, :] >= starts
    else:
        raise ValueError(f"unknown mask kind {kind!r}")
    return mx.array(mask)


@st.composite
def core_cases(
    draw,
    dtypes=tuple(DTYPES),
    max_batch=2,
    tokens=st.one_of(st.sampled_from(BOUNDARY_TOKENS), st.integers(1, 200)),
    with_state=st.booleans(),
):
    """A core op call over the shapes and options of docs/contract.md."""
    head_dims = st.one_of(st.sampled_from(HEAD_DIMS), st.sampled_from(ODD_HEAD_DIMS))
    key_heads = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(dtypes))
    return make_core_case(
        draw(st.integers(0, 2**32 - 1)),
        batch=draw(st.integers(1, max_batch)),
        tokens=draw(tokens),
        key_heads=key_heads,
        value_heads=key_heads * draw(st.sampled_from(HEAD_RATIOS)),
        key_dim=draw(head_dims),
        value_dim=draw(head_dims),
        dtype=dtype,
        gate_dtype=draw(st.sampled_from(("float32", dtype))),
        decay=draw(st.sampled_from(tuple(DECAY_RANGES))),
        beta_max=draw(st.sampled_from((1.0, 2.0))),
        with_state=draw(with_state),
        mask_kind=draw(st.sampled_from(("none", "random", "left_padding"))),
        normalize_qk=draw(st.booleans()),
        scale=draw(st.sampled_from((None, 0.5, 1.0))),
        head_mapping=draw(st.sampled_from(("grouped", "interleaved"))),
    )


def snapshot(arrays):
    """Float64 copies of mlx arrays (None kept), to check nothing wrote them."""
    return [None if a is None else to_float64(a) for a in arrays]
