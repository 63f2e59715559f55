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
from mlx_gated_delta.testing import metal_emulated
from mlx_gated_delta.testing.contracts import CONTRACTS, assert_matches

# The reviewed fingerprints of the stage contracts.
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
    "stage.prepare_conv.v1.float32.qkv": "471261cb83284557db8af1213443bfac47c9b012fef7464c840791f94bd35504",
    "stage.prepare_gates.v1.float32.gates": "2cbb01d6e869fb64a54a959f9cd4d99d2f16725fe57867b05d61a563c7dab58f",
    "stage.collect_conv_state.v1.any.conv_state": "9c1d2e1b849416b4874475984849ca849c85e9a8e9b6ac87a01e4d949401672d",
    "stage.gated_norm.v1.float32.output": "c5c8f198607aac731b18d5c44f1098157b39056130dfd36ab3604b10bbe5a7fb",
}

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


def check(name, actual, expected, contract_id):
    assert_matches(name, actual, expected, contract_id, FINGERPRINTS[contract_id])


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


def test_the_fingerprints_are_the_registry_s():
    for contract_id, fingerprint in FINGERPRINTS.items():
        assert CONTRACTS[contract_id].fingerprint == fingerprint, contract_id


# --- The segment's own stages -------------------------------------------------

SEGMENT = dict(key_heads=1, value_heads=2, key_dim=8, value_dim=4)


@pytest.fixture(scope="module")
def segment_case():
    rng = np.random.default_rng(3)
    f32 = np.float32
    batch, tokens, taps = 2, 9, 4
    layout = reference.SegmentLayout(**SEGMENT)
    mixed = rng.standard_normal((batch, tokens, layout.packed_width)).astype(f32)
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
