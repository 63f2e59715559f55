"""Every stage of the CPU chunked form against its namesake in the float64
reference (`reference.chunked_stages`; docs/stages.md), each under the stage
contracts the Metal stages meet (tests/metal/test_stage_scratch.py): a wrong
CPU stage fails its own test, named after it.

The CPU kernel records each stage's output chunk by chunk when traced
(`_ext.trace_cpu_chunked_stages`, the same pipeline with a trace). The data
are those of the Metal stage tests: normalised q and k, beta in [0, 1], g in
[-1, 0], a wipe (g = -inf), masked tokens and a partial last chunk. Rows
(and tile columns) past the last token are padding no stage defines, and
above a tile's diagonal the CPU computes only what its products need: both
are left out of the comparison by taking them from the reference.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import _ext, reference
from mlx_gated_delta.testing.contracts import assert_matches

# Two value heads on one key head (the wipe is on head 0); 150 tokens: two
# full chunks and a partial one.
TOKENS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 150, 2, 128, 16
CHUNK = reference.CHUNK_SIZE


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    f32 = np.float32
    q = rng.standard_normal((1, TOKENS, 1, KEY_DIM)).astype(f32)
    k = rng.standard_normal((1, TOKENS, 1, KEY_DIM)).astype(f32)
    v = rng.standard_normal((1, TOKENS, VALUE_HEADS, VALUE_DIM)).astype(f32)
    g = -rng.uniform(0.0, 1.0, (1, TOKENS, VALUE_HEADS)).astype(f32)
    g[:, 70, 0] = -np.inf  # a wipe inside the second chunk, on a kept token
    beta = rng.uniform(0.0, 1.0, (1, TOKENS, VALUE_HEADS)).astype(f32)
    state = (0.5 * rng.standard_normal((1, VALUE_HEADS, VALUE_DIM, KEY_DIM))).astype(f32)
    mask = rng.uniform(size=(1, TOKENS)) > 0.2
    mask[:, 70] = True
    return q, k, v, g, beta, state, mask


@pytest.fixture(scope="module")
def expected(inputs):
    return reference.chunked_stages(*inputs[:6], mask=inputs[6], normalize_qk=True)


def trace(inputs, head):
    """The CPU's stage outputs for value head `head`, as NumPy arrays."""
    q, k, v, g, beta, state, mask = (mx.array(x) for x in inputs)
    out = _ext.trace_cpu_chunked_stages(
        q, k, v, g, beta, state, mask, KEY_DIM**-0.5, "grouped", True, 0, head
    )
    return {name: np.array(value) for name, value in out.items()}


@pytest.fixture(scope="module", params=range(VALUE_HEADS), ids=lambda h: f"head{h}")
def case(request, inputs, expected):
    head = request.param
    return head, trace(inputs, head), expected


def defined(shape, tile=False):
    """True where a [C, L, ...] entry is a real token's (and, for tiles, on or
    below the diagonal, between real tokens)."""
    chunks, length = shape[:2]
    real = (np.arange(chunks * length) < TOKENS).reshape(chunks, length)
    if not tile:
        return real.reshape(real.shape + (1,) * (len(shape) - 2))
    lower = np.tril(np.ones((length, length), dtype=bool))
    return real[:, :, None] & real[:, None, :] & lower


def compared(actual, expected, tile=False):
    """`actual` ([C, L, ...], one problem) as `expected`'s [1, 1, C, L, ...]
    slice, its undefined entries taken from `expected`."""
    actual = actual[None, None]
    return np.where(defined(actual.shape[2:], tile)[None, None], actual, expected)


def test_qk_norm(case, inputs):
    """The CPU keeps the normalised rows, not the inverse norms: each row is
    its raw row times the inverse norm, read back by projecting onto the raw
    row (a row of the wrong length or direction reads back wrong)."""
    _, cpu, _ = case
    for name, rows, raw in (
        ("query_inverse_norm", cpu["q"], inputs[0]),
        ("key_inverse_norm", cpu["k"], inputs[1]),
    ):
        x = raw[0, :, 0].astype(np.float64)
        rows = rows.reshape(-1, KEY_DIM)[:TOKENS].astype(np.float64)
        read_back = np.sum(rows * x, axis=-1) / np.sum(x * x, axis=-1)
        expected = 1.0 / np.sqrt(np.sum(x * x, axis=-1) + reference.QK_NORM_EPS)
        assert_matches(
            name,
            read_back[None, :, None],
            expected[None, :, None],
            "stage.qk_norm.v1.float32.inverse_norm",
        )


def test_gate_cumsum(case):
    head, cpu, expected = case
    h = slice(head, head + 1)
    for name, contract in (
        ("log_cumsum", "stage.gate_cumsum.v1.float32.log_cumsum"),
        ("last_wipe", "stage.gate_cumsum.v1.int32.last_wipe"),
        ("beta_effective", "stage.gate_cumsum.v1.float32.beta"),
    ):
        reference_stage = expected[name][:, h]
        assert_matches(name, compared(cpu[name], reference_stage), reference_stage, contract)


@pytest.mark.parametrize(
    "name, contract",
    [
        ("k_gram", "stage.k_gram.v1.float32.tile"),
        ("qk", "stage.chunk_qk.v1.float32.tile"),
        ("kkt_inverse", "stage.kkt_inverse.v1.float32.tile"),
    ],
)
def test_tiles(case, name, contract):
    head, cpu, expected = case
    # k_gram and chunk_qk are the key head's (the only one, 0).
    h = slice(0, 1) if name in ("k_gram", "qk") else slice(head, head + 1)
    reference_stage = expected[name][:, h]
    assert_matches(name, compared(cpu[name], reference_stage, tile=True), reference_stage, contract)


@pytest.mark.parametrize(
    "name, contract",
    [
        ("w", "stage.recompute_w_u.v1.float32.w"),
        ("u", "stage.recompute_w_u.v1.float32.u"),
        ("corrected", "stage.chunk_carry.v1.float32.corrected"),
        ("output_inter", "stage.chunk_carry.v1.float32.output_inter"),
    ],
)
def test_rows(case, name, contract):
    head, cpu, expected = case
    actual = cpu[name]
    if name == "output_inter":
        # The CPU applies the scale once, to the whole output row, in
        # chunk_output; the reference scales each part.
        actual = actual.astype(np.float64) * KEY_DIM**-0.5
    reference_stage = expected[name][:, head : head + 1]
    assert_matches(name, compared(actual, reference_stage), reference_stage, contract)


def test_chunk_carry_state(case):
    """The state after each chunk: the next chunk's entry state, and after
    the last chunk the final state."""
    head, cpu, expected = case
    chunks = cpu["exit_states"].shape[0]
    assert chunks == -(-TOKENS // CHUNK)
    after = list(expected["entry_states"][0, head, 1:]) + [expected["state"][0, head]]
    for chunk in range(chunks):
        assert_matches(
            f"state after chunk {chunk}",
            cpu["exit_states"][chunk][None, None],
            after[chunk][None, None],
            "stage.chunk_carry.v1.float32.state",
        )
    assert_matches(
        "state",
        cpu["state"][None, None],
        expected["state"][:, head : head + 1],
        "stage.chunk_carry.v1.float32.state",
    )


def test_chunk_output(case):
    head, cpu, expected = case
    assert_matches(
        "y",
        cpu["y"][None, :, None],
        expected["y"][:, :, head : head + 1],
        "stage.chunk_output.v1.float32.output",
    )


def test_a_wrong_stage_fails_its_own_test(case):
    """The probe: the CPU's W with one entry off by ten times its
    contract (a bug in
    recompute_w_u) fails recompute_w_u's contract, which names the stage,
    while the untouched U still passes its own."""
    head, cpu, expected = case
    w = cpu["w"].copy()
    w[1, 5, 3] += 1e-3 * np.abs(w).max()  # ten times the contract
    reference_w = expected["w"][:, head : head + 1]
    with pytest.raises(AssertionError, match="stage.recompute_w_u.v1.float32.w"):
        assert_matches(
            "w", compared(w, reference_w), reference_w, "stage.recompute_w_u.v1.float32.w"
        )
    reference_u = expected["u"][:, head : head + 1]
    assert_matches(
        "u", compared(cpu["u"], reference_u), reference_u, "stage.recompute_w_u.v1.float32.u"
    )


def test_a_stage_compared_with_the_wrong_reference_stage_fails(case):
    """The probe for the trace's order: the CPU's U before chunk_carry is
    not the reference's corrected V' (nor the reverse), so a trace recorded
    at the wrong point of the pipeline fails the stage it claims to be."""
    head, cpu, expected = case
    reference_corrected = expected["corrected"][:, head : head + 1]
    with pytest.raises(AssertionError, match="stage.chunk_carry.v1.float32.corrected"):
        assert_matches(
            "corrected",
            compared(cpu["u"], reference_corrected),
            reference_corrected,
            "stage.chunk_carry.v1.float32.corrected",
        )


def test_the_trace_is_the_kernel_s_result(inputs):
    """Tracing changes nothing: the traced run's y and state are the normal
    CPU kernel's, bit for bit."""
    from mlx_gated_delta.testing.guarded import run_core_guarded

    q, k, v, g, beta, state, mask = inputs
    y, state_out, _, _ = run_core_guarded(
        q, k, v, g, beta, state, mask=mask, normalize_qk=True, algorithm="chunked"
    )
    for head in range(VALUE_HEADS):
        cpu = trace(inputs, head)
        np.testing.assert_array_equal(cpu["y"], np.asarray(y)[0, :, head])
        np.testing.assert_array_equal(cpu["state"], np.asarray(state_out)[0, head])
