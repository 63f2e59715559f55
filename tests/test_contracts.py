"""The numerical contract registry and its `assert_matches` helper."""

import hashlib
import re

import numpy as np
import pytest

from mlx_gated_delta.testing import contracts
from mlx_gated_delta.testing.contracts import CONTRACTS, Contract, assert_matches

F32_OUTPUT = "core.recurrent.v2.float32.output"
F32_OUTPUT_FINGERPRINT = "b8d4bf432be51cb8c0a7c6234e15d988487624b77195f1609b8ffe9e2319189d"
F32_STATE = "core.recurrent.v2.float32.state"
F32_STATE_FINGERPRINT = "ce7ea3651fc1efcbb3c3b508677dc73770b29c2ec53aa49adcb89722f3768260"


def output_like(seed=0, shape=(2, 5, 3, 4)):
    return np.random.default_rng(seed).standard_normal(shape)


def test_registry_ids_metrics_and_fingerprints_are_well_formed():
    assert len(CONTRACTS) >= 16
    for contract_id, contract in CONTRACTS.items():
        assert contract.id == contract_id
        assert re.fullmatch(r"[a-z_]+\.[a-z_]+\.v\d+\.[a-z0-9]+\.[a-z_]+", contract_id), contract_id
        assert contract.metric in contracts.METRICS
        assert contract.layout in contracts.LAYOUTS
        assert contract.threshold >= 0.0
        # A relative metric needs a floor under its denominator.
        assert (contract.magnitude_floor > 0) == (contract.metric != "max_abs")
        assert contract.canonical_text == (
            f"{contract.id}|{contract.metric}|{contract.threshold!r}|{contract.layout}"
            f"|{contract.magnitude_floor!r}"
        )
    fingerprints = [c.fingerprint for c in CONTRACTS.values()]
    assert len(set(fingerprints)) == len(fingerprints)


def test_fingerprint_is_the_sha256_of_the_canonical_text():
    contract = Contract("x.y.v1.float32.output", "max_rel", 0.5, "[B,T,H,D]", 0.01)
    text = b"x.y.v1.float32.output|max_rel|0.5|[B,T,H,D]|0.01"
    assert contract.fingerprint == hashlib.sha256(text).hexdigest()
    loosened = Contract("x.y.v1.float32.output", "max_rel", 0.6, "[B,T,H,D]", 0.01)
    assert loosened.fingerprint != contract.fingerprint
    floored_higher = Contract("x.y.v1.float32.output", "max_rel", 0.5, "[B,T,H,D]", 0.1)
    assert floored_higher.fingerprint != contract.fingerprint


def test_a_fingerprint_mismatch_fails_even_when_the_values_agree():
    expected = output_like()
    with pytest.raises(AssertionError, match="fingerprint"):
        assert_matches("y", expected, expected, F32_OUTPUT, "0" * 64)


def test_an_unknown_contract_fails():
    expected = output_like()
    with pytest.raises(AssertionError, match="no numerical contract"):
        assert_matches("y", expected, expected, "core.nothing.v1.float32.output", "0" * 64)


def test_values_within_the_contract_pass_and_return_the_metric():
    expected = output_like()
    actual = expected * (1 + 1e-6)
    value = assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)
    assert 0 < value <= 1e-6 * (1 + 1e-9)


def test_a_violation_names_the_worst_element_and_its_index():
    expected = output_like()
    actual = expected.copy()
    actual[1, 3, 2, 0] += 0.5  # the worst
    actual[0, 1, 1, 1] += 0.01  # also over the threshold, but smaller
    with pytest.raises(AssertionError) as failure:
        assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)
    message = str(failure.value)
    assert "index (1, 3, 2, 0)" in message
    assert F32_OUTPUT in message and "max_rel" in message
    assert repr(float(actual[1, 3, 2, 0])) in message
    assert repr(float(expected[1, 3, 2, 0])) in message


def test_max_rel_divides_by_the_magnitude_of_each_batch_row_and_head():
    expected = output_like()
    # Head 1 of batch row 0 is ten times smaller than the others (and still
    # above the floor): an error within 1e-4 of the others is not within
    # 1e-4 of that head, and must be caught.
    expected[0, :, 1, :] *= 0.1
    actual = expected.copy()
    actual[0, 2, 1, 3] += 5e-5
    with pytest.raises(AssertionError, match=r"index \(0, 2, 1, 3\)"):
        assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)
    actual = expected.copy()
    actual[1, 2, 1, 3] += 5e-5
    assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)


def test_max_rel_groups_the_state_by_its_own_batch_and_head_axes():
    expected = output_like(shape=(2, 3, 4, 5))  # [B, H, Dv, Dk]
    expected[1, 2] *= 0.1
    actual = expected.copy()
    actual[1, 2, 3, 4] += 5e-5
    with pytest.raises(AssertionError, match=r"index \(1, 2, 3, 4\)"):
        assert_matches("state", actual, expected, F32_STATE, F32_STATE_FINGERPRINT)


def test_groups_below_the_magnitude_floor_are_judged_in_absolute_terms():
    contract = CONTRACTS[F32_OUTPUT]
    assert contract.magnitude_floor == 1e-2
    expected = output_like()
    expected[0, :, 0, :] = 0.0  # a fully masked batch row and head
    expected[1, :, 2, :] *= 1e-6  # a head whose values all cancelled
    allowed = contract.threshold * contract.magnitude_floor  # 1e-6
    actual = expected.copy()
    actual[0, 4, 0, 2] = 0.5 * allowed
    actual[1, 4, 2, 2] += 0.5 * allowed
    assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)
    actual[0, 4, 0, 2] = 2 * allowed
    with pytest.raises(AssertionError, match=r"index \(0, 4, 0, 2\)"):
        assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)
    actual[0, 4, 0, 2] = 0.0
    actual[1, 4, 2, 2] += 2 * allowed
    with pytest.raises(AssertionError, match=r"index \(1, 4, 2, 2\)"):
        assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)


def test_nan_and_inf_never_pass():
    expected = output_like()
    for bad in (np.nan, np.inf):
        actual = expected.copy()
        actual[1, 0, 2, 1] = bad
        with pytest.raises(AssertionError, match=r"index \(1, 0, 2, 1\)"):
            assert_matches("y", actual, expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)


def test_a_shape_mismatch_fails():
    expected = output_like()
    with pytest.raises(AssertionError, match="shape"):
        assert_matches("y", expected[:, :4], expected, F32_OUTPUT, F32_OUTPUT_FINGERPRINT)


def test_an_exact_contract_rejects_any_difference():
    contract = CONTRACTS["core.recurrent_split.v1.any.output"]
    assert contract.metric == "max_abs" and contract.threshold == 0.0
    expected = output_like()
    assert_matches("y", expected.copy(), expected, contract.id, contract.fingerprint)
    actual = expected.copy()
    actual[0, 0, 0, 0] = np.nextafter(actual[0, 0, 0, 0], np.inf)
    with pytest.raises(AssertionError, match=r"index \(0, 0, 0, 0\)"):
        assert_matches("y", actual, expected, contract.id, contract.fingerprint)


def test_norm_ratio_measures_the_whole_tensor(monkeypatch):
    contract = Contract("test.norm.v1.float32.output", "norm_ratio", 1e-3, "[B,T,H,D]", 1e-2)
    monkeypatch.setitem(CONTRACTS, contract.id, contract)
    expected = output_like()
    actual = expected.copy()
    # One element off by 5e-4 of the tensor's norm: the ratio is exactly that.
    actual[0, 0, 0, 0] += 5e-4 * np.linalg.norm(expected)
    value = assert_matches("y", actual, expected, contract.id, contract.fingerprint)
    assert value == pytest.approx(5e-4)
    actual = expected * 1.01
    with pytest.raises(AssertionError, match="norm_ratio = 1.000e-02"):
        assert_matches("y", actual, expected, contract.id, contract.fingerprint)
