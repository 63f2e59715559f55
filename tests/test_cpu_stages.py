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
from mlx_gated_delta.testing.contracts import CONTRACTS, assert_matches

# The reviewed fingerprints of the stage contracts (the Metal stage tests').
FINGERPRINTS = {
    "stage.qk_norm.v1.float32.inverse_norm": "52e9cd19f40f72e833d3439a048aa71eaf6d57f61772a8c15ee0ea7d1f407c5b",
    "stage.gate_cumsum.v1.float32.log_cumsum": "d85aa2cd65478ff246ebd541fbde6721174e82d8f5cc45a89a5a946f09f597aa",
    "stage.gate_cumsum.v1.int32.last_wipe": "dab1d7c8edc4ba9fa0d93b2a6577bab5a2fae8d21c85a4c93a51b9d734341909",
    "stage.gate_cumsum.v1.float32.beta": "1c8ef7e70bfe6691566838b72dd85a3792c04f6b4c2bd0db4b840ca2808f1816",
    "stage.k_gram.v1.float32.tile": "49a9cb397484ea366ddd15c46f34bc7a348f5b8ee5a08ce4f2c148b7d41e3250",
    "stage.chunk_qk.v1.float32.tile": "97f1853ab56173f3077e20c1265d7c6142f89fa3d06bb6a0195a281ec880dad5",
    "stage.kkt_inverse.v1.float32.tile": "cff559439ad591d179e8110389fed78db22e51ad8bd2e2aa81260f12c44e391f",
    "stage.recompute_w_u.v1.float32.w": "816761863dc0db6eb02ec9bd2017d392e3fa9f359a81c6c7ef7957a1d68fa428",
    "stage.recompute_w_u.v1.float32.u": "3eaf699b7916b174725393b4348129dadc76247c4289c083dc4d65f63807aa76",
    "stage.chunk_carry.v1.float32.corrected": "d6a609b342496b52f9396667d5b1c2f156647226dc373482292d872786d97f49",
    "stage.chunk_carry.v1.float32.output_inter": "98da6acaa58f01ede57e1488808b3e15ec1166b2e3ebc7145b4f884055da465e",
    "stage.chunk_carry.v1.float32.state": "4ba8a10f152fae4cca58f35ce6fddff1661ac5c984441aa846763d573611256d",
    "stage.chunk_output.v1.float32.output": "10677c8d9dedac72625c433547b10f5ac478b6401eb1fa5cc82f6a9f496b724c",
}

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


def check(name, actual, expected, contract_id):
    assert_matches(name, actual, expected, contract_id, FINGERPRINTS[contract_id])


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
        check(
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
        check(name, compared(cpu[name], reference_stage), reference_stage, contract)


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
    check(name, compared(cpu[name], reference_stage, tile=True), reference_stage, contract)


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
    check(name, compared(actual, reference_stage), reference_stage, contract)


def test_chunk_carry_state(case):
    """The state after each chunk: the next chunk's entry state, and after
    the last chunk the final state."""
    head, cpu, expected = case
    chunks = cpu["exit_states"].shape[0]
    assert chunks == -(-TOKENS // CHUNK)
    after = list(expected["entry_states"][0, head, 1:]) + [expected["state"][0, head]]
    for chunk in range(chunks):
        check(
            f"state after chunk {chunk}",
            cpu["exit_states"][chunk][None, None],
            after[chunk][None, None],
            "stage.chunk_carry.v1.float32.state",
        )
    check(
        "state",
        cpu["state"][None, None],
        expected["state"][:, head : head + 1],
        "stage.chunk_carry.v1.float32.state",
    )


def test_chunk_output(case):
    head, cpu, expected = case
    check(
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
        check("w", compared(w, reference_w), reference_w, "stage.recompute_w_u.v1.float32.w")
    reference_u = expected["u"][:, head : head + 1]
    check("u", compared(cpu["u"], reference_u), reference_u, "stage.recompute_w_u.v1.float32.u")


def test_a_stage_compared_with_the_wrong_reference_stage_fails(case):
    """The probe for the trace's order: the CPU's U before chunk_carry is
    not the reference's corrected V' (nor the reverse), so a trace recorded
    at the wrong point of the pipeline fails the stage it claims to be."""
    head, cpu, expected = case
    reference_corrected = expected["corrected"][:, head : head + 1]
    with pytest.raises(AssertionError, match="stage.chunk_carry.v1.float32.corrected"):
        check(
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


def test_the_fingerprints_are_the_registry_s():
    for contract_id, fingerprint in FINGERPRINTS.items():
        assert CONTRACTS[contract_id].fingerprint == fingerprint, contract_id
