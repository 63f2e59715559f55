"""Every stage of the CPU chunked form with per-key-channel gates against
its namesake in the float64 reference (`reference.per_key_chunked_stages`;
docs/stages.md), as tests/test_cpu_stages.py does for scalar gates.

The gates take every path of key_decayed_grams' sub-chunks: weak channels
(g in [-1, 0], the diagonal blocks as products), strong ones (g = -30 a
step: the log decay moves past kProductLogLimit within a sub-chunk, so
those channels' diagonal blocks are formed pair by pair), and wipes of
single channels inside a sub-chunk, on a sub-chunk's first row and on a
chunk's last token. Masked tokens and a partial last chunk as well.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import _ext, reference
from mlx_gated_delta.testing.contracts import assert_matches

TOKENS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 150, 2, 64, 16


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(1)
    f32 = np.float32
    q = rng.standard_normal((1, TOKENS, 1, KEY_DIM)).astype(f32)
    k = rng.standard_normal((1, TOKENS, 1, KEY_DIM)).astype(f32)
    v = rng.standard_normal((1, TOKENS, VALUE_HEADS, VALUE_DIM)).astype(f32)
    g = -rng.uniform(0.0, 1.0, (1, TOKENS, VALUE_HEADS, KEY_DIM)).astype(f32)
    g[..., ::5] = -30.0
    for t, h, c in ((70, 0, 1), (80, 1, 2), (63, 0, 3), (96, 1, 1)):
        g[0, t, h, c] = -np.inf
    beta = rng.uniform(0.0, 1.0, (1, TOKENS, VALUE_HEADS)).astype(f32)
    state = (0.5 * rng.standard_normal((1, VALUE_HEADS, VALUE_DIM, KEY_DIM))).astype(f32)
    mask = rng.uniform(size=(1, TOKENS)) > 0.2
    mask[:, [63, 70, 80, 96]] = True
    return q, k, v, g, beta, state, mask


@pytest.fixture(scope="module")
def expected(inputs):
    return reference.per_key_chunked_stages(*inputs[:6], mask=inputs[6], normalize_qk=True)


def trace(inputs, head):
    q, k, v, g, beta, state, mask = (mx.array(x) for x in inputs)
    out = _ext.trace_cpu_chunked_stages(
        q, k, v, g, beta, state, mask, KEY_DIM**-0.5, "grouped", True, 0, head
    )
    return {name: np.array(value) for name, value in out.items()}


@pytest.fixture(scope="module", params=range(VALUE_HEADS), ids=lambda h: f"head{h}")
def case(request, inputs, expected):
    head = request.param
    return head, trace(inputs, head), expected


def compared(actual, expected, tile=False):
    """`actual` ([C, L, ...]) as `expected`'s [1, 1, C, L, ...] slice, the
    entries past the last token (and above a tile's diagonal) taken from
    `expected`: no stage defines them."""
    chunks, length = actual.shape[:2]
    real = (np.arange(chunks * length) < TOKENS).reshape(chunks, length)
    if tile:
        lower = np.tril(np.ones((length, length), dtype=bool))
        defined = real[:, :, None] & real[:, None, :] & lower
    else:
        defined = real.reshape(real.shape + (1,) * (actual.ndim - 2))
    return np.where(defined[None, None], actual[None, None], expected)


def test_key_gate_cumsum(case):
    head, cpu, expected = case
    h = slice(head, head + 1)
    assert cpu["log_cumsum"].shape == cpu["last_wipe"].shape == (3, 64, KEY_DIM)
    for name, contract in (
        ("log_cumsum", "stage.key_gate_cumsum.v1.float32.log_cumsum"),
        ("last_wipe", "stage.key_gate_cumsum.v1.int32.last_wipe"),
    ):
        reference_stage = expected[name][:, h]
        assert_matches(name, compared(cpu[name], reference_stage), reference_stage, contract)
    beta = expected["beta_effective"][:, h]
    assert_matches(
        "beta", compared(cpu["beta_effective"], beta), beta, "stage.gate_cumsum.v1.float32.beta"
    )


@pytest.mark.parametrize("name", ["k_gram", "qk"])
def test_key_decayed_grams(case, name):
    head, cpu, expected = case
    reference_stage = expected[name][:, head : head + 1]
    assert_matches(
        name,
        compared(cpu[name], reference_stage, tile=True),
        reference_stage,
        "stage.key_decayed_grams.v1.float32.tile",
    )


@pytest.mark.parametrize(
    "name, contract",
    [
        ("kkt_inverse", "stage.kkt_inverse.v1.float32.tile"),
        ("w", "stage.recompute_w_u.v1.float32.w"),
        ("u", "stage.recompute_w_u.v1.float32.u"),
        ("corrected", "stage.chunk_carry.v1.float32.corrected"),
        ("output_inter", "stage.chunk_carry.v1.float32.output_inter"),
    ],
)
def test_the_later_stages(case, name, contract):
    head, cpu, expected = case
    actual = cpu[name]
    if name == "output_inter":
        actual = actual.astype(np.float64) * KEY_DIM**-0.5  # as tests/test_cpu_stages.py
    reference_stage = expected[name][:, head : head + 1]
    tile = name == "kkt_inverse"
    assert_matches(name, compared(actual, reference_stage, tile), reference_stage, contract)


def test_chunk_carry_state_and_output(case):
    head, cpu, expected = case
    after = list(expected["entry_states"][0, head, 1:]) + [expected["state"][0, head]]
    for chunk, state in enumerate(after):
        assert_matches(
            f"state after chunk {chunk}",
            cpu["exit_states"][chunk][None, None],
            state[None, None],
            "stage.chunk_carry.v1.float32.state",
        )
    assert_matches(
        "y",
        cpu["y"][None, :, None],
        expected["y"][:, :, head : head + 1],
        "stage.chunk_output.v1.float32.output",
    )


def test_a_gram_with_one_wrong_channel_fails_its_stage(case, inputs):
    """The probe: the CPU's decayed Q K^T with one strong channel's decay
    taken as 1 inside each diagonal block (a pair-path bug) fails
    key_decayed_grams' contract."""
    head, cpu, expected = case
    q_rows = reference.chunk_rows(expected["q"])[:, [0]]
    k_rows = reference.chunk_rows(expected["k"])[:, [0]]
    c = 5  # a strong channel
    same_block = (np.arange(64)[:, None] // 16) == (np.arange(64)[None, :] // 16)
    lower = np.tril(np.ones((64, 64), dtype=bool), k=-1)
    missing = q_rows[..., :, None, c] * k_rows[..., None, :, c]
    wrong = cpu["qk"] + np.where(same_block & lower, missing[0, 0], 0.0)
    reference_stage = expected["qk"][:, head : head + 1]
    with pytest.raises(AssertionError, match="stage.key_decayed_grams"):
        assert_matches(
            "qk",
            compared(wrong, reference_stage, tile=True),
            reference_stage,
            "stage.key_decayed_grams.v1.float32.tile",
        )


def test_the_trace_is_the_kernel_s_result(inputs):
    """Tracing changes nothing: the traced run's y and state are the kernel's,
    bit for bit."""
    from mlx_gated_delta.testing.guarded import run_core_guarded

    q, k, v, g, beta, state, mask = inputs
    y, state_out, _, _ = run_core_guarded(
        q, k, v, g, beta, state, mask=mask, normalize_qk=True, algorithm="chunked"
    )
    for head in range(VALUE_HEADS):
        cpu = trace(inputs, head)
        np.testing.assert_array_equal(cpu["y"], np.asarray(y)[0, :, head])
        np.testing.assert_array_equal(cpu["state"], np.asarray(state_out)[0, head])
