"""Every stage of the Metal plans, run by the emulator up to and including
that stage, against its namesake in the float64 reference
(`reference.chunked_stages` and the segment oracle's stages; docs/stages.md),
each under its own contract: a wrong stage fails its own test, named after it.

The data are O(1) and well conditioned by construction (normalised q and k,
beta in [0, 1], g in [-1, 0]), with a wipe (g = -inf), masked tokens and a
partial last chunk. Rows and columns past the last token are padding that no
stage defines: they are left out of the comparison.
"""

import numpy as np
import pytest

from mlx_gated_delta import reference
from mlx_gated_delta.testing.contracts import assert_matches as check

import metal_emulated

# Dk = 128 with two value heads per key head: the plan runs every chunked
# stage, k_gram included (uses_chunk_k_gram_k128). 150 tokens: two full
# chunks and a partial one.
SHAPE = dict(batch=1, tokens=150, key_heads=1, value_heads=2, key_dim=128, value_dim=16)


def core_inputs(seed=0, batch=1, tokens=150, key_heads=1, value_heads=2, key_dim=128, value_dim=16):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    q = rng.standard_normal((batch, tokens, key_heads, key_dim)).astype(f32)
    k = rng.standard_normal((batch, tokens, key_heads, key_dim)).astype(f32)
    v = rng.standard_normal((batch, tokens, value_heads, value_dim)).astype(f32)
    g = -rng.uniform(0.0, 1.0, (batch, tokens, value_heads)).astype(f32)
    g[:, 70, 0] = -np.inf  # a wipe inside the second chunk, on a kept token
    beta = rng.uniform(0.0, 1.0, (batch, tokens, value_heads)).astype(f32)
    state = (0.5 * rng.standard_normal((batch, value_heads, value_dim, key_dim))).astype(f32)
    mask = rng.uniform(size=(batch, tokens)) > 0.2
    mask[:, 70] = True
    return q, k, v, g, beta, state, mask


@pytest.fixture(scope="module")
def case():
    q, k, v, g, beta, state, mask = core_inputs()
    expected = reference.chunked_stages(q, k, v, g, beta, state, mask=mask, normalize_qk=True)
    return (q, k, v, g, beta, state, mask), expected


def run_through(stage, inputs):
    q, k, v, g, beta, state, mask = inputs
    y, state_out, info = metal_emulated.run(
        q,
        k,
        v,
        g,
        beta,
        state,
        mask=mask,
        normalize_qk=True,
        algorithm="chunked",
        through_stage=stage,
    )
    assert info["kernels"], stage
    buffers = metal_emulated.stage_buffers(info["buffers"], **SHAPE)
    return y, state_out, buffers


def valid_rows(shape_prefix_ndim, array, tokens=SHAPE["tokens"]):
    """True where a [.., C, L, ..] row is a real token (not padding)."""
    chunks, length = array.shape[shape_prefix_ndim : shape_prefix_ndim + 2]
    valid = (np.arange(chunks * length) < tokens).reshape(chunks, length)
    return valid.reshape(
        (1,) * shape_prefix_ndim + valid.shape + (1,) * (array.ndim - shape_prefix_ndim - 2)
    )


def padded_as_expected(actual, expected, tile=False):
    """`actual` with its padding rows (and, for tiles, columns) taken from
    `expected`: the comparison sees the real tokens only."""
    valid = valid_rows(2, actual)
    if tile:
        columns = np.swapaxes(valid_rows(2, np.swapaxes(actual, -1, -2)), -1, -2)
        valid = valid & columns
    return np.where(valid, actual, expected)


def test_the_stage_list_is_the_plans():
    stages = [
        d["stage"]
        for d in metal_emulated.plan_dispatches(**SHAPE, normalize_qk=True, algorithm="chunked")
    ]
    assert stages == [
        "qk_norm",
        "gate_cumsum",
        "k_gram",
        "kkt_inverse",
        "recompute_w_u",
        "chunk_qk",
        "chunk_carry",
        "chunk_output",
    ]


def test_qk_norm(case):
    inputs, _ = case
    q, k = inputs[0], inputs[1]
    _, _, buffers = run_through("qk_norm", inputs)
    for name, x in (("query_inverse_norm", q), ("key_inverse_norm", k)):
        x = x.astype(np.float64)
        expected = 1.0 / np.sqrt(np.sum(x * x, axis=-1) + reference.QK_NORM_EPS)
        check(name, buffers[name], expected, "stage.qk_norm.v1.float32.inverse_norm")


def test_gate_cumsum(case):
    inputs, expected = case
    _, _, buffers = run_through("gate_cumsum", inputs)
    check(
        "gate_cumsum",
        buffers["gate_cumsum"],
        expected["log_cumsum"],
        "stage.gate_cumsum.v1.float32.log_cumsum",
    )
    check(
        "last_wipe",
        buffers["last_wipe"],
        expected["last_wipe"],
        "stage.gate_cumsum.v1.int32.last_wipe",
    )
    check(
        "beta_effective",
        buffers["beta_effective"],
        expected["beta_effective"],
        "stage.gate_cumsum.v1.float32.beta",
    )


def test_k_gram(case):
    inputs, expected = case
    _, _, buffers = run_through("k_gram", inputs)
    check(
        "k_gram",
        padded_as_expected(buffers["k_gram"], expected["k_gram"], tile=True),
        expected["k_gram"],
        "stage.k_gram.v1.float32.tile",
    )


def test_kkt_inverse(case):
    inputs, expected = case
    _, _, buffers = run_through("kkt_inverse", inputs)
    check(
        "kkt_inverse",
        padded_as_expected(buffers["kkt_inverse"], expected["kkt_inverse"], tile=True),
        expected["kkt_inverse"],
        "stage.kkt_inverse.v1.float32.tile",
    )


def test_recompute_w_u(case):
    inputs, expected = case
    _, _, buffers = run_through("recompute_w_u", inputs)
    for name in ("w", "u"):
        check(
            name,
            padded_as_expected(buffers[name], expected[name]),
            expected[name],
            f"stage.recompute_w_u.v1.float32.{name}",
        )


def test_chunk_qk(case):
    inputs, expected = case
    _, _, buffers = run_through("chunk_qk", inputs)
    check(
        "qk",
        padded_as_expected(buffers["qk"], expected["qk"], tile=True),
        expected["qk"],
        "stage.chunk_qk.v1.float32.tile",
    )


def test_chunk_carry(case):
    inputs, expected = case
    _, state_out, buffers = run_through("chunk_carry", inputs)
    # chunk_carry overwrites U with the corrected values v'.
    check(
        "corrected",
        padded_as_expected(buffers["u"], expected["corrected"]),
        expected["corrected"],
        "stage.chunk_carry.v1.float32.corrected",
    )
    check(
        "output_inter",
        padded_as_expected(buffers["output_inter"], expected["output_inter"]),
        expected["output_inter"],
        "stage.chunk_carry.v1.float32.output_inter",
    )
    check("state", state_out, expected["state"], "stage.chunk_carry.v1.float32.state")


def test_chunk_output(case):
    inputs, expected = case
    y, _, _ = run_through("chunk_output", inputs)
    check("y", y, expected["y"], "stage.chunk_output.v1.float32.output")


def test_a_wrong_stage_fails_its_own_test(case):
    """The probe: W with one row perturbed (a bug in recompute_w_u) fails
    recompute_w_u's contract, which names the stage."""
    inputs, expected = case
    _, _, buffers = run_through("recompute_w_u", inputs)
    w = buffers["w"].copy()
    w[0, 1, 1, 5] *= 1.01
    with pytest.raises(AssertionError, match="stage.recompute_w_u"):
        check(
            "w",
            padded_as_expected(w, expected["w"]),
            expected["w"],
            "stage.recompute_w_u.v1.float32.w",
        )


# --- The segment's own stages -------------------------------------------------

SEGMENT = dict(key_heads=1, value_heads=2, key_dim=8, value_dim=4)


@pytest.fixture(scope="module")
def segment_case():
    rng = np.random.default_rng(3)
    f32 = np.float32
    batch, tokens, taps = 2, 9, 4
    layout = reference.SegmentLayout(**SEGMENT)
    mixed = rng.standard_normal((batch, tokens, layout.mixed_qkvzba_width)).astype(f32)
    conv_weight = (0.5 * rng.standard_normal((layout.channels, taps))).astype(f32)
    decay_parameter = rng.standard_normal(SEGMENT["value_heads"]).astype(f32)
    dt_bias = rng.standard_normal(SEGMENT["value_heads"]).astype(f32)
    norm_weight = rng.standard_normal(SEGMENT["value_dim"]).astype(f32)
    conv_state = rng.standard_normal((batch, taps - 1, layout.channels)).astype(f32)
    state = rng.standard_normal((batch, 2, 4, 8)).astype(f32)
    mask = rng.uniform(size=(batch, tokens)) > 0.3
    args = (mixed, conv_weight, decay_parameter, dt_bias, norm_weight, conv_state, state)
    return args, mask, layout


def run_segment_through(stage, segment_case):
    args, mask, _ = segment_case
    out, conv_state, _, info = metal_emulated.run_segment(
        *args, **SEGMENT, mask=mask, through_stage=stage
    )
    return out, conv_state, info["buffers"]


def test_prepare_conv(segment_case):
    (mixed, conv_weight, _, _, _, conv_state, _), mask, layout = segment_case
    _, _, buffers = run_segment_through("prepare_conv", segment_case)
    qkv = reference.prepare_conv(
        mixed.astype(np.float64),
        conv_weight.astype(np.float64),
        conv_state.astype(np.float64),
        mask,
        layout,
    )
    batch, tokens = mask.shape
    qk, hk, dk = layout.qk_width, SEGMENT["key_heads"], SEGMENT["key_dim"]
    parts = {
        "q": (qkv[..., :qk], hk, dk),
        "k": (qkv[..., qk : 2 * qk], hk, dk),
        "v": (qkv[..., 2 * qk :], SEGMENT["value_heads"], SEGMENT["value_dim"]),
    }
    for name, (expected, heads, dim) in parts.items():
        actual = np.frombuffer(buffers[name], np.float32).reshape(batch, tokens, heads, dim)
        check(
            name,
            actual,
            expected.reshape(batch, tokens, heads, dim),
            "stage.prepare_conv.v1.float32.qkv",
        )


def test_prepare_gates(segment_case):
    (mixed, _, decay_parameter, dt_bias, _, _, _), mask, layout = segment_case
    _, _, buffers = run_segment_through("prepare_gates", segment_case)
    g, beta = reference.prepare_gates(mixed.astype(np.float64), decay_parameter, dt_bias, layout)
    for name, expected in (("g", g), ("beta", beta)):
        actual = np.frombuffer(buffers[name], np.float32).reshape(expected.shape)
        check(name, actual, expected, "stage.prepare_gates.v1.float32.gates")


def test_collect_conv_state(segment_case):
    (mixed, _, _, _, _, conv_state, _), mask, layout = segment_case
    _, conv_state_out, _ = run_segment_through("collect_conv_state", segment_case)
    expected = reference.collect_conv_state(
        mixed.astype(np.float64), conv_state.astype(np.float64), mask, layout
    )
    check("conv_state", conv_state_out, expected, "stage.collect_conv_state.v1.any.conv_state")


def test_gated_norm(segment_case):
    (mixed, _, _, _, norm_weight, _, _), mask, layout = segment_case
    out, _, buffers = run_segment_through("gated_norm", segment_case)
    # gated_norm's input is the core's float32 y, as the plan left it.
    y = np.frombuffer(buffers["y"], np.float32).reshape(out.shape)
    expected = reference.gated_norm(y, mixed.astype(np.float64), norm_weight, mask, layout)
    check("out", out, expected, "stage.gated_norm.v1.float32.output")
