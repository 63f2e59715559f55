"""The float64 references built from stages (docs/stages.md) against the
oracles they decompose: the chunked form, stage by stage, equals the recurrent
oracle; the segment oracle is its stages composed. Each stage of the kernels is
compared with these stage functions in tests/metal/test_stage_scratch.py."""

import numpy as np
import pytest

from mlx_gated_delta import reference
from mlx_gated_delta.testing.contracts import assert_matches


def core_inputs(seed, batch=2, tokens=150, key_heads=2, value_heads=4, key_dim=16, value_dim=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, tokens, key_heads, key_dim))
    k = rng.standard_normal((batch, tokens, key_heads, key_dim))
    v = rng.standard_normal((batch, tokens, value_heads, value_dim))
    g = -rng.uniform(0.0, 1.0, (batch, tokens, value_heads))
    for b, t, h in ((0, 70, 1), (1, 63, 0)):  # wipes, one on a chunk's last token
        if t < tokens:
            g[b, t, h] = -np.inf
    beta = rng.uniform(0.0, 1.0, (batch, tokens, value_heads))
    state = rng.standard_normal((batch, value_heads, value_dim, key_dim))
    mask = rng.uniform(size=(batch, tokens)) > 0.2
    return q, k, v, g, beta, state, mask


@pytest.mark.parametrize("head_mapping", ["grouped", "interleaved"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [1, 64, 150])
def test_the_chunked_reference_is_the_recurrence(head_mapping, masked, tokens):
    q, k, v, g, beta, state, mask = core_inputs(tokens, tokens=tokens)
    options = dict(head_mapping=head_mapping, mask=mask if masked else None, normalize_qk=True)
    y, final = reference.gated_delta_rule_chunked_reference(q, k, v, g, beta, state, **options)
    expected_y, expected_state = reference.gated_delta_rule_reference(
        q, k, v, g, beta, state, **options
    )
    assert_matches("y", y, expected_y, "reference.chunked.v1.float64.output")
    assert_matches("state", final, expected_state, "reference.chunked.v1.float64.state")


def test_a_chunk_size_of_one_is_the_recurrence_too():
    q, k, v, g, beta, state, mask = core_inputs(7, tokens=20)
    y, final = reference.gated_delta_rule_chunked_reference(
        q, k, v, g, beta, state, mask=mask, chunk_size=1
    )
    expected_y, expected_state = reference.gated_delta_rule_reference(
        q, k, v, g, beta, state, mask=mask
    )
    assert_matches("y", y, expected_y, "reference.chunked.v1.float64.output")
    assert_matches("state", final, expected_state, "reference.chunked.v1.float64.state")


def test_the_entry_states_are_the_recurrence_at_chunk_boundaries():
    q, k, v, g, beta, state, mask = core_inputs(3, tokens=130)
    stages = reference.chunked_stages(q, k, v, g, beta, state, mask=mask)
    for chunk, start in enumerate((0, 64, 128)):
        _, expected = reference.gated_delta_rule_reference(
            q[:, :start],
            k[:, :start],
            v[:, :start],
            g[:, :start],
            beta[:, :start],
            state,
            mask=mask[:, :start],
        )
        assert_matches(
            f"entry state {chunk}",
            stages["entry_states"][:, :, chunk],
            expected,
            "reference.chunked.v1.float64.state",
        )


def test_kkt_inverse_inverts():
    q, k, v, g, beta, state, mask = core_inputs(5)
    stages = reference.chunked_stages(q, k, v, g, beta, state, mask=mask, normalize_qk=True)
    inverse = stages["kkt_inverse"]
    # T is unit lower triangular.
    assert np.array_equal(np.diagonal(inverse, axis1=-2, axis2=-1), np.ones(inverse.shape[:-1]))
    assert np.all(np.triu(inverse, k=1) == 0)


def test_a_wrong_stage_breaks_the_chunked_reference():
    """The probe: a chunk_carry that skips the W S^T correction of the
    entry state is caught by the comparison with the recurrence."""
    q, k, v, g, beta, state, mask = core_inputs(11)
    stages = reference.chunked_stages(q, k, v, g, beta, state, mask=mask)
    # Skip the W S^T correction: v' = U.
    y = reference.chunk_output(
        stages["qk"][:, reference.key_head_of(4, 2, "grouped")],
        stages["u"],
        stages["output_inter"],
        stages["log_cumsum"],
        stages["last_wipe"],
        mask,
        16**-0.5,
    )
    expected_y, _ = reference.gated_delta_rule_reference(q, k, v, g, beta, state, mask=mask)
    with pytest.raises(AssertionError, match="reference.chunked"):
        assert_matches("y", y, expected_y, "reference.chunked.v1.float64.output")


def test_the_segment_oracle_is_its_stages():
    rng = np.random.default_rng(2)
    layout = reference.SegmentLayout(key_heads=1, value_heads=2, key_dim=4, value_dim=3)
    batch, tokens, taps = 2, 7, 3
    x = rng.standard_normal((batch, tokens, layout.mixed_qkvzba_width))
    weight = rng.standard_normal((layout.channels, taps))
    window = rng.standard_normal((batch, taps - 1, layout.channels))
    mask = np.array([[1, 0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1]], dtype=bool)
    qkv = reference.prepare_conv(x, weight, window, mask, layout)
    # The last token of row 1 is its only kept one: its window is the carried
    # state and itself.
    rows = np.concatenate([window[1], x[1, 6:, : layout.channels]])
    conv = np.einsum("kc,ck->c", rows, weight)
    np.testing.assert_allclose(qkv[1, 6], conv / (1 + np.exp(-conv)), rtol=1e-14)
    assert not qkv[1, :6].any() and not qkv[0, [1, 4]].any()
    state = reference.collect_conv_state(x, window, mask, layout)
    np.testing.assert_array_equal(
        state[1], np.concatenate([window[1, 1:], x[1, 6:, : layout.channels]])
    )
    np.testing.assert_array_equal(state[0], x[0, [5, 6], : layout.channels])


def per_key_inputs(seed, tokens=150, key_dim=16):
    """`core_inputs` with a decay per key channel: g [B, T, Hv, Dk], some
    channels strong (down to -30 a step) beside weak ones, and wipes of
    single channels (one on a chunk's last token)."""
    q, k, v, _, beta, state, mask = core_inputs(seed, tokens=tokens, key_dim=key_dim)
    rng = np.random.default_rng(seed + 1)
    g = -rng.uniform(0.0, 1.0, v.shape[:3] + (key_dim,))
    g[..., ::3] *= 30.0
    for b, t, h, c in ((0, 70, 1, 2), (1, 63, 0, 5), (1, 20, 3, 0)):
        if t < tokens:
            g[b, t, h, c] = -np.inf
    return q, k, v, g, beta, state, mask


@pytest.mark.parametrize("head_mapping", ["grouped", "interleaved"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [1, 64, 150])
def test_the_per_key_chunked_reference_is_the_recurrence(head_mapping, masked, tokens):
    q, k, v, g, beta, state, mask = per_key_inputs(tokens, tokens=tokens)
    options = dict(head_mapping=head_mapping, mask=mask if masked else None, normalize_qk=True)
    stages = reference.per_key_chunked_stages(q, k, v, g, beta, state, **options)
    expected_y, expected_state = reference.gated_delta_rule_reference(
        q, k, v, g, beta, state, **options
    )
    assert_matches("y", stages["y"], expected_y, "reference.chunked.v1.float64.output")
    assert_matches("state", stages["state"], expected_state, "reference.chunked.v1.float64.state")


def test_per_key_stages_with_equal_channels_are_the_scalar_stages():
    """A g whose channels all equal the scalar g: the per-key stages give the
    scalar stages' decayed tiles, W and state (float64, up to rounding)."""
    q, k, v, g, beta, state, mask = core_inputs(4)
    per_key_g = np.repeat(g[..., None], q.shape[3], axis=-1)
    scalar = reference.chunked_stages(q, k, v, g, beta, state, mask=mask, normalize_qk=True)
    per_key = reference.per_key_chunked_stages(
        q, k, v, per_key_g, beta, state, mask=mask, normalize_qk=True
    )
    key_head = reference.key_head_of(4, 2, "grouped")
    decay = reference.chunk_decay(scalar["log_cumsum"], scalar["last_wipe"])
    decayed_qk = decay * scalar["qk"][:, key_head]
    np.testing.assert_allclose(per_key["qk"], decayed_qk, rtol=0, atol=1e-12)
    for name in ("kkt_inverse", "w", "corrected", "state"):
        np.testing.assert_allclose(per_key[name], scalar[name], rtol=0, atol=1e-10, err_msg=name)


def test_key_decayed_grams_take_each_channel_s_own_decay():
    """The probe: grams decayed by channel 0's decay alone (what a kernel
    ignoring the channels would build) are not the stage's result."""
    q, k, v, g, beta, state, mask = per_key_inputs(8)
    stages = reference.per_key_chunked_stages(q, k, v, g, beta, state, mask=mask)
    key_head = reference.key_head_of(4, 2, "grouped")
    q_rows = reference.chunk_rows(q)[:, key_head]
    k_rows = reference.chunk_rows(k)[:, key_head]
    channel_0 = [
        np.repeat(x[..., :1], x.shape[-1], axis=-1)
        for x in (stages["log_cumsum"], stages["last_wipe"])
    ]
    wrong_k_gram, wrong_qk = reference.key_decayed_grams(q_rows, k_rows, *channel_0)
    assert np.abs(wrong_qk - stages["qk"]).max() > 1e-2 * np.abs(stages["qk"]).max()
    assert np.abs(wrong_k_gram - stages["k_gram"]).max() > 1e-2 * np.abs(stages["k_gram"]).max()
