"""Property tests of the core op `gated_delta_rule` (docs/contract.md).

Ordinary pytest functions, run both by the repository's `pytest` and by
`python -m mlx_gated_delta selftest`, on the default device. The budget comes from the Hypothesis profile chosen by
MLX_GATED_DELTA_HYPOTHESIS_PROFILE (see `strategies`).
"""

import functools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import gated_delta_rule, gated_delta_update
from mlx_gated_delta.reference import (
    gated_delta_update_reference,
    to_float64,
)
from mlx_gated_delta.testing.contracts import assert_matches, term_magnitudes
from mlx_gated_delta.testing.guarded import run_core_guarded
from mlx_gated_delta.testing.strategies import core_cases, make_core_case, snapshot

ALGORITHMS = ("recurrent", "chunked")

# (id, fingerprint) of the reviewed contracts these properties hold.
ORACLE_OUTPUT_CONTRACTS = {
    ("recurrent", "float32"): "core.recurrent.v3.float32.output",
    ("recurrent", "float16"): "core.recurrent.v3.float16.output",
    ("recurrent", "bfloat16"): "core.recurrent.v3.bfloat16.output",
    ("chunked", "float32"): "core.chunked.v3.float32.output",
    ("chunked", "float16"): "core.chunked.v3.float16.output",
    ("chunked", "bfloat16"): "core.chunked.v3.bfloat16.output",
}
ORACLE_STATE_CONTRACTS = {
    "recurrent": "core.recurrent.v3.float32.state",
    "chunked": "core.chunked.v3.float32.state",
}
SPLIT_CONTRACTS = {
    "recurrent": (
        "core.recurrent_split.v1.any.output",
        "core.recurrent_split.v1.float32.state",
    ),
    "chunked": (
        "core.chunked_split.v3.float32.output",
        "core.chunked_split.v3.float32.state",
    ),
}
# The chunked form against the recurrent one (float32): y, then the state.
ALGORITHMS_AGREE_CONTRACTS = (
    "core.chunked_vs_recurrent.v3.float32.output",
    "core.chunked_vs_recurrent.v3.float32.state",
)
# The chunked split contract is a float32 one: in float16/bfloat16 a moved
# chunk boundary may flip the final rounding of y by one ulp.
SPLIT_DTYPES = {"recurrent": ("float32", "float16", "bfloat16"), "chunked": ("float32",)}


def oracle_terms(case, algorithm, call_starts=(0,)):
    """The `terms` of `algorithm`'s contracts for y and the final state, for
    a case run in calls starting at `call_starts` (`CoreCase.terms`)."""
    output_terms, state_terms = case.terms(algorithm, call_starts)
    return output_terms, state_terms[:, -1]


def split_terms(case, bounds, algorithm="chunked"):
    """`terms` of SPLIT_CONTRACTS[algorithm] for two runs of one case, in one
    call and in calls [bounds[i], bounds[i+1]): none for the recurrent form
    (bitwise equal); for the chunked form, each run meets its contract
    against its own chunks' terms, so both meet it against the larger."""
    if algorithm == "recurrent":
        return None, None
    whole, split = oracle_terms(case, algorithm), oracle_terms(case, algorithm, bounds[:-1])
    return tuple(np.maximum(a, b) for a, b in zip(whole, split))


def assert_matches_oracle(case, y, state, algorithm):
    """y and the final state of `algorithm` on `case` against the float64 oracle."""
    expected_y, expected_state = case.reference()
    output_terms, state_terms = oracle_terms(case, algorithm)
    output_contract = ORACLE_OUTPUT_CONTRACTS[algorithm, dtype_name(case.v)]
    assert_matches("y", y, expected_y, output_contract, terms=output_terms)
    assert_matches(
        "state", state, expected_state, ORACLE_STATE_CONTRACTS[algorithm], terms=state_terms
    )


def run(case, algorithm, **overrides):
    """The op on a case, evaluated: (y, state)."""
    options = {**case.options, **overrides}
    y, state = gated_delta_rule(*case.args(), algorithm=algorithm, **options)
    mx.eval(y, state)
    return y, state


@functools.cache
def second_stream():
    """One more stream on the default device, made once (a stream is a thread)."""
    return mx.new_stream(mx.default_device())


def dtype_name(array):
    return str(array.dtype).rsplit(".", 1)[-1]


def assert_bitwise_equal(name, actual, expected):
    assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    assert mx.array_equal(actual, expected, equal_nan=True).item(), f"{name} differs"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_matches_the_float64_oracle(algorithm, case):
    y, state = run(case, algorithm)
    assert y.dtype == case.v.dtype and state.dtype == mx.float32
    assert_matches_oracle(case, y, state, algorithm)


@pytest.mark.parametrize("tokens", (1, 2, 63, 64, 65, 127, 128, 129, 145, 192))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_chunked_matches_the_oracle_at_every_chunk_boundary(tokens, dtype):
    # Fixed cases at and around multiples of the chunk (64), whatever the
    # Hypothesis budget draws: full chunks, ragged last chunks, one token.
    case = make_core_case(
        tokens,
        batch=2,
        tokens=tokens,
        key_heads=2,
        value_heads=4,
        key_dim=32,
        value_dim=16,
        dtype=dtype,
        mask_kind="random",
        head_mapping="interleaved",
    )
    assert_matches_oracle(case, *run(case, "chunked"), "chunked")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_chunk_that_contracts_a_huge_state(algorithm):
    # 64 unit keys in 3 dimensions, beta up to 1 and no decay: each direction
    # of the state is projected away some 20 times, so the exit state is many
    # orders of magnitude below the 1e18 entry state. Each algorithm sums
    # terms of the entry state's size (a chunk at once, or a step at a time),
    # so its float32 error is relative to them, not to the small exit state
    # (docs/numerics.md, "What each algorithm guarantees"); the contracting
    # regime of `core_cases` draws such cases at random as well.
    case = make_core_case(
        4,
        batch=1,
        tokens=64,
        key_heads=1,
        value_heads=4,
        key_dim=3,
        value_dim=32,
        decay="none",
        state_scale="huge",
        normalize_qk=True,
    )
    _, expected_state = case.reference()
    _, state_terms = oracle_terms(case, algorithm)
    assert np.abs(expected_state).max() < 1e-3 * state_terms.min()
    assert_matches_oracle(case, *run(case, algorithm), algorithm)


@given(case=core_cases(dtypes=("float32",)))
def test_chunked_matches_recurrent(case):
    recurrent_y, recurrent_state = run(case, "recurrent")
    chunked_y, chunked_state = run(case, "chunked")
    output_terms, state_terms = oracle_terms(case, "chunked")
    assert_matches("y", chunked_y, recurrent_y, ALGORITHMS_AGREE_CONTRACTS[0], terms=output_terms)
    assert_matches(
        "state", chunked_state, recurrent_state, ALGORITHMS_AGREE_CONTRACTS[1], terms=state_terms
    )


@given(case=core_cases())
def test_auto_is_one_of_the_algorithms(case):
    auto_y, auto_state = run(case, "auto")
    for algorithm in ALGORITHMS:
        y, state = run(case, algorithm)
        if mx.array_equal(y, auto_y).item() and mx.array_equal(state, auto_state).item():
            return
    raise AssertionError("algorithm='auto' gave a result that no algorithm gives")


@st.composite
def split_cases(draw, algorithm):
    case = draw(core_cases(dtypes=SPLIT_DTYPES[algorithm]))
    tokens = case.q.shape[1]
    # Any split points, chunk-unaligned ones included; a repeated point (or
    # 0, or T) makes an empty call in the middle of the sequence.
    points = draw(st.lists(st.integers(0, tokens), min_size=1, max_size=3))
    return case, sorted(points)


def run_in_calls(case, bounds, algorithm):
    """The tokens of a case in consecutive calls [bounds[i], bounds[i+1]),
    each passing its state to the next: (concatenated y, final state)."""
    state = case.state
    pieces = []
    for start, stop in zip(bounds[:-1], bounds[1:]):

        def part(x):
            return None if x is None else x[:, start:stop]

        y, state = gated_delta_rule(
            *(part(x) for x in case.args()[:5]),
            state,
            algorithm=algorithm,
            **{**case.options, "mask": part(case.options["mask"])},
        )
        pieces.append(y)
    y = mx.concatenate(pieces, axis=1)
    mx.eval(y, state)
    return y, state


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_split_continuity_any_split_points(algorithm, data):
    case, points = data.draw(split_cases(algorithm))
    bounds = [0, *points, case.q.shape[1]]
    full_y, full_state = run(case, algorithm)
    split_y, split_state = run_in_calls(case, bounds, algorithm)
    output_terms, state_terms = split_terms(case, bounds, algorithm)
    output_contract, state_contract = SPLIT_CONTRACTS[algorithm]
    assert_matches("y", split_y, full_y, output_contract, terms=output_terms)
    assert_matches("state", split_state, full_state, state_contract, terms=state_terms)


@given(case=core_cases(dtypes=("float32",), tokens=st.integers(2, 160)), data=st.data())
def test_prefill_then_token_by_token_decode_matches_one_call(case, data):
    # How a model runs: one call over the prompt, then one call per new token,
    # each with algorithm "auto" (so the two algorithms meet through the state).
    tokens = case.q.shape[1]
    prompt = data.draw(st.integers(1, tokens - 1), label="prompt tokens")
    bounds = [0, *range(prompt, tokens + 1)]
    full_y, full_state = run(case, "auto")
    decoded_y, decoded_state = run_in_calls(case, bounds, "auto")
    output_terms, state_terms = split_terms(case, bounds)
    assert_matches("y", decoded_y, full_y, ALGORITHMS_AGREE_CONTRACTS[0], terms=output_terms)
    assert_matches(
        "state", decoded_state, full_state, ALGORITHMS_AGREE_CONTRACTS[1], terms=state_terms
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_inputs_are_never_modified(algorithm, case):
    inputs = [*case.args(), case.options["mask"]]
    mx.eval([x for x in inputs if x is not None])
    before = snapshot(inputs)
    run(case, algorithm)
    for name, original, now in zip(
        ("q", "k", "v", "g", "beta", "state", "mask"), before, snapshot(inputs)
    ):
        if original is not None:
            assert np.array_equal(original, now), f"{name} was written by the op"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases(with_state=st.just(True)))
def test_masked_tokens_output_exact_zeros_and_leave_the_state(algorithm, case):
    # docs/contract.md: a False mask step leaves the state unchanged and outputs 0,
    # exactly (not merely within the contract).
    mask = case.options["mask"]
    if mask is None:
        rng = np.random.default_rng(case.recipe["seed"])
        mask = mx.array(rng.uniform(size=case.g.shape[:2]) < 0.5)
    y, _ = run(case, algorithm, mask=mask)
    skipped = ~np.asarray(mask)
    assert not np.any(to_float64(y)[skipped]), "a masked token has a nonzero output"

    nothing = mx.zeros_like(mask)
    y, state = run(case, algorithm, mask=nothing)
    assert not np.any(to_float64(y)), "a fully masked call has a nonzero output"
    assert_bitwise_equal("state", state, case.state)


@pytest.mark.parametrize("algorithm", ("auto", *ALGORITHMS))
@given(case=core_cases(tokens=st.just(0), several_chunks=False))
def test_zero_tokens_return_empty_output_and_the_state_unchanged(algorithm, case):
    y, state = run(case, algorithm)
    B, _, Hk, Dk = case.q.shape
    Hv, Dv = case.v.shape[2:]
    assert y.shape == (B, 0, Hv, Dv) and y.dtype == case.v.dtype
    expected_state = (
        mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32) if case.state is None else case.state
    )
    assert_bitwise_equal("state", state, expected_state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_same_call_twice_is_bitwise_identical(algorithm, case):
    first_y, first_state = run(case, algorithm)
    second_y, second_state = run(case, algorithm)
    assert_bitwise_equal("y", second_y, first_y)
    assert_bitwise_equal("state", second_state, first_state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_works_under_compile(algorithm, case):
    # mx.compile passes arrays only: a None state and the options stay in
    # the closure.
    arrays = [x for x in case.args() if x is not None]

    def step(*arrays):
        q, k, v, g, beta, *state = arrays
        return gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            state[0] if state else None,
            algorithm=algorithm,
            **case.options,
        )

    eager_y, eager_state = run(case, algorithm)
    compiled_y, compiled_state = mx.compile(step)(*arrays)
    assert_bitwise_equal("y", compiled_y, eager_y)
    assert_bitwise_equal("state", compiled_state, eager_state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_vmap_is_one_call_per_mapped_slice(algorithm, case):
    # Map over a new leading axis of three different slices (scaling down
    # keeps beta and |k| in their ranges); a None state stays unmapped.
    mask = case.options["mask"]
    options = {name: value for name, value in case.options.items() if name != "mask"}
    arrays = [x for x in case.args() if x is not None]
    arrays = [mx.stack([x, 0.5 * x, 0.25 * x]) for x in arrays]
    if mask is not None:
        arrays.append(mx.stack([mask, ~mask, mask]))

    def call(q, k, v, g, beta, *rest):
        rest = list(rest)
        slice_mask = rest.pop() if mask is not None else None
        state = rest.pop() if rest else None
        return gated_delta_rule(
            q, k, v, g, beta, state, mask=slice_mask, algorithm=algorithm, **options
        )

    mapped_y, mapped_state = mx.vmap(call)(*arrays)
    for i in range(3):
        y, state = call(*(x[i] for x in arrays))
        assert_bitwise_equal(f"y[{i}]", mapped_y[i], y)
        assert_bitwise_equal(f"state[{i}]", mapped_state[i], state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_strided_inputs_give_the_result_of_their_contiguous_copies(algorithm, case):
    # Views with other strides: every other element of an array twice as
    # long in the head dim; gates and state read through a transpose of an
    # array stored transposed.
    def every_other(x):
        return mx.repeat(x, 2, axis=-1)[..., ::2]

    def transposed_view(x, axis1, axis2):
        if x is None:
            return None
        stored_transposed = mx.contiguous(mx.swapaxes(x, axis1, axis2))
        return mx.swapaxes(stored_transposed, axis1, axis2)

    contiguous_y, contiguous_state = run(case, algorithm)
    q, k, v, g, beta, state = case.args()
    y, final = gated_delta_rule(
        every_other(q),
        every_other(k),
        every_other(v),
        transposed_view(g, 1, 2),
        transposed_view(beta, 0, 1),
        transposed_view(state, 2, 3),
        algorithm=algorithm,
        **case.options,
    )
    assert_bitwise_equal("y", y, contiguous_y)
    assert_bitwise_equal("state", final, contiguous_state)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases())
def test_any_stream_of_the_device_gives_the_same_result(algorithm, case):
    default_y, default_state = run(case, algorithm)
    y, state = run(case, algorithm, stream=second_stream())
    assert_bitwise_equal("y", y, default_y)
    assert_bitwise_equal("state", state, default_state)


def test_forward_mode_differentiation_raises_a_clear_error():
    q = mx.ones((1, 3, 1, 16)) * 0.1
    v = mx.ones((1, 3, 1, 16))
    g = mx.zeros((1, 3, 1))

    def outputs(v):
        return gated_delta_rule(q, q, v, g, g + 0.5)

    with pytest.raises(Exception) as failure:
        mx.eval(mx.jvp(outputs, [v], [mx.ones_like(v)]))
    message = str(failure.value)
    assert "gated_delta_rule" in message and "jvp" in message


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(case=core_cases(with_state=st.just(True)))
def test_state_guard_no_write_past_the_outputs(algorithm, case):
    sentinel = 73.25
    y, state, y_tail, state_tail = run_core_guarded(
        *case.args(), **case.options, algorithm=algorithm, sentinel=sentinel
    )
    # y's sentinel words hold the sentinel in y's dtype (73.25 is 73.0 in bfloat16).
    y_sentinel = mx.array(sentinel, dtype=case.v.dtype).astype(mx.float32).item()
    assert y_tail.size == 16 and state_tail.size == 16
    assert np.all(y_tail == y_sentinel), f"y written past its end: {y_tail}"
    assert np.all(state_tail == sentinel), f"state written past its end: {state_tail}"
    # The guarded run is the same kernel: its results meet the same contracts.
    assert_matches_oracle(case, y, state, algorithm)


# The edges, drawn on purpose rather than left to the general strategy's
# luck: wipes at chunk edges and in runs, with severe or mixed decays around
# them, at the token counts around chunk boundaries.
EDGE_TOKENS = (63, 64, 65, 127, 128)
# gated_delta_update (algorithm "auto", so either form) against the float64
# oracle: the chunked form's contracts, which the recurrent one meets too.
UPDATE_ORACLE_CONTRACTS = {
    "float32": "compat.update_oracle.v3.float32.output",
    "bfloat16": "compat.update_oracle.v3.bfloat16.output",
}
UPDATE_ORACLE_STATE_CONTRACT = "compat.update_oracle.v3.float32.state"


def update_terms(q, k, v, gamma, beta, state=None, mask=None):
    """The `terms` of the update oracle contracts for y and the final state
    of `gated_delta_update(q, k, v, gamma, beta, state, mask)`."""
    output_terms, state_terms = term_magnitudes(
        q, k, v, mx.log(gamma), beta, state, algorithm="auto", scale=1.0, mask=mask
    )
    return output_terms, state_terms[:, -1, :, None, None]


def assert_update_matches_oracle(y, state, q, k, v, gamma, beta, initial_state=None, mask=None):
    """gated_delta_update's (y, state) against the float64 oracle."""
    arguments = (q, k, v, gamma, beta, initial_state, mask)
    expected_y, expected_state = gated_delta_update_reference(*arguments)
    output_terms, state_terms = update_terms(*arguments)
    output_contract = UPDATE_ORACLE_CONTRACTS[dtype_name(v)]
    assert_matches("y", y, expected_y, output_contract, terms=output_terms)
    assert_matches("state", state, expected_state, UPDATE_ORACLE_STATE_CONTRACT, terms=state_terms)


@st.composite
def wipe_cases(
    draw,
    wipes,
    dtypes=("float32", "bfloat16"),
    wipe_value=-np.inf,
    state_scales=("unit", "huge"),
    per_key_gates=False,
):
    """Wipes of kind `wipes` at the edge token counts; with per-key gates a
    wipe lies on a single channel."""
    return make_core_case(
        draw(st.integers(0, 2**32 - 1)),
        batch=draw(st.integers(1, 2)),
        tokens=draw(st.sampled_from(EDGE_TOKENS)),
        key_heads=1,
        value_heads=draw(st.sampled_from((1, 2))),
        key_dim=draw(st.sampled_from((16, 32))),
        value_dim=draw(st.sampled_from((8, 16))),
        dtype=draw(st.sampled_from(dtypes)),
        decay=draw(st.sampled_from(("model", "severe", "mixed", "none"))),
        mask_kind=draw(st.sampled_from(("none", "random", "left_padding", "right_padding"))),
        head_mapping=draw(st.sampled_from(("grouped", "interleaved"))),
        wipes=wipes,
        wipe_value=wipe_value,
        state_scale=draw(st.sampled_from(state_scales)),
        per_key_gates=per_key_gates,
    )


@pytest.mark.parametrize("wipes", ("random", "chunk_edges", "runs"))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_wipes_match_the_float64_oracle(algorithm, wipes, data):
    case = data.draw(wipe_cases(wipes))
    assert_matches_oracle(case, *run(case, algorithm), algorithm)


# Finite wipes: a g far below float32's exp range is a wipe as -inf is. The
# chunked form must restart its cumulative sums there too: a sum that kept
# it would leave every later decay a difference of two numbers that large.
FINITE_WIPES = (-1e4, -3e38)


@pytest.mark.parametrize("per_key_gates", (False, True))
@pytest.mark.parametrize("wipe_value", FINITE_WIPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(data=st.data())
def test_finite_wipes_match_the_float64_oracle(algorithm, wipe_value, per_key_gates, data):
    # Per-key gates: each channel's cumulative sum restarts at its own wipes.
    case = data.draw(wipe_cases("runs", wipe_value=wipe_value, per_key_gates=per_key_gates))
    assert_matches_oracle(case, *run(case, algorithm), algorithm)


@pytest.mark.parametrize("wipes", ("random", "chunk_edges", "runs"))
@given(data=st.data())
def test_gamma_zero_wipes_through_gated_delta_update(wipes, data):
    # The MLX-compatible entry point: gamma = exp(g), so a wipe is gamma == 0
    # exactly (log(0) = -inf inside); the oracle sees the same gamma's log.
    case = data.draw(wipe_cases(wipes))
    gamma = mx.exp(case.g.astype(mx.float32))
    assert mx.any(gamma == 0).item() or not np.any(np.isneginf(to_float64(case.g)))
    arguments = (case.q, case.k, case.v, gamma, case.beta, case.state, case.options["mask"])
    assert_update_matches_oracle(*gated_delta_update(*arguments), *arguments)


@pytest.mark.parametrize("algorithm", ("auto", *ALGORITHMS))
@pytest.mark.parametrize(
    "batch, tokens, value_heads, value_dim",
    [(0, 5, 2, 8), (0, 0, 2, 8), (0, 70, 2, 8), (2, 70, 0, 8), (2, 70, 2, 0), (1, 0, 0, 0)],
)
def test_zero_size_batch_value_heads_or_value_dim_give_empty_results(
    algorithm, batch, tokens, value_heads, value_dim
):
    # Nothing to compute: y and the state are empty arrays of the right shapes
    # (Hk and Dk of zero are errors: tests/test_errors.py).
    q = mx.ones((batch, tokens, 1, 8))
    v = mx.ones((batch, tokens, value_heads, value_dim))
    g = mx.full((batch, tokens, value_heads), -0.5)
    state = mx.ones((batch, value_heads, value_dim, 8))
    for initial in (None, state):
        y, final = gated_delta_rule(q, q * 0.1, v, g, g + 1.0, initial, algorithm=algorithm)
        mx.eval(y, final)
        assert y.shape == v.shape and y.dtype == v.dtype
        assert final.shape == state.shape and final.dtype == mx.float32
        if tokens == 0 and initial is not None:
            assert_bitwise_equal("state", final, state)


# MLX's CUDA backend: a key dim past its kernels (256) raises when the op is
# called, naming the call and the CPU, rather than running elsewhere; the
# same call on the CPU runs.
@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend only")
def test_cuda_call_past_the_kernels_raises_and_names_the_cpu():
    case = make_core_case(
        1, batch=1, tokens=3, key_heads=1, value_heads=1, key_dim=257, value_dim=8
    )
    arguments = (case.q, case.k, case.v, case.g, case.beta, case.state)
    gamma_arguments = (case.q, case.k, case.v, mx.exp(case.g), case.beta, case.state)
    for call, args, name in (
        (gated_delta_rule, arguments, "gated_delta_rule"),
        (gated_delta_update, gamma_arguments, "gated_delta_update"),
    ):
        with pytest.raises(ValueError, match=rf"{name} on the GPU .* key dim 257 .*stream=mx\.cpu"):
            call(*args, stream=mx.gpu)
        mx.eval(call(*args, stream=mx.cpu))
