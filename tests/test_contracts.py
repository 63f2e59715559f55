"""The numerical contract registry, the table of reviewed fingerprints and
`assert_matches`."""

import ast
import dataclasses
import hashlib
import inspect
import re

import numpy as np
import pytest

from mlx_gated_delta.testing import contracts, fingerprints
from mlx_gated_delta.testing.contracts import (
    CONTRACTS,
    Contract,
    assert_matches,
    review_disagreements,
)

# Two float32 contracts of 1e-4 against the result's magnitude.
F32_OUTPUT = "stage.chunk_output.v1.float32.output"
F32_STATE = "stage.chunk_carry.v1.float32.state"
# The same threshold, against the magnitude of the recurrent form's terms.
TERMS_OUTPUT = "core.recurrent.v3.float32.output"


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
        assert contract.magnitude in contracts.MAGNITUDES
        assert contract.magnitude == "result" or contract.metric in ("max_rel", "norm_ratio")
        magnitude = "" if contract.magnitude == "result" else f"|{contract.magnitude}"
        assert contract.canonical_text == (
            f"{contract.id}|{contract.metric}|{contract.threshold!r}|{contract.layout}"
            f"|{contract.magnitude_floor!r}{magnitude}"
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
    of_terms = Contract("x.y.v1.float32.output", "max_rel", 0.5, "[B,T,H,D]", 0.01, "terms")
    assert of_terms.fingerprint == hashlib.sha256(text + b"|terms").hexdigest()


def test_the_reviewed_table_and_the_registry_agree_both_ways():
    # Every registered contract has its reviewed fingerprint, every reviewed
    # fingerprint a registered contract, and each is the contract's own.
    assert review_disagreements() == []


def test_the_reviewed_table_has_one_line_a_contract_in_order():
    # A key written twice in a dict literal silently keeps the last value:
    # read the table's source, not the dict.
    table = ast.parse(inspect.getsource(fingerprints)).body[-1].value
    ids = [key.value for key in table.keys]
    assert ids == sorted(set(ids))
    assert all(len(value.value) == 64 for value in table.values)


def test_review_disagreements_finds_a_missing_a_stale_and_a_changed_entry():
    kept, changed, unreviewed = (CONTRACTS[i] for i in (F32_OUTPUT, F32_STATE, TERMS_OUTPUT))
    registry = {c.id: c for c in (kept, dataclasses.replace(changed, threshold=2e-4), unreviewed)}
    reviewed = {c.id: c.fingerprint for c in (kept, changed)}
    reviewed["core.removed.v1.float32.output"] = "0" * 64
    problems = review_disagreements(registry, reviewed)
    stale, missing = "core.removed.v1.float32.output", TERMS_OUTPUT
    assert [p.split(":")[0] for p in problems] == sorted((stale, missing, F32_STATE))
    problem = dict(p.split(": ", 1) for p in problems)
    assert problem[stale] == "a reviewed fingerprint, but no such contract (stale)"
    assert problem[missing] == "no reviewed fingerprint"
    assert problem[F32_STATE].startswith(f"fingerprint {registry[F32_STATE].fingerprint}")
    assert f"reviewed as {changed.fingerprint}" in problem[F32_STATE]


def test_a_threshold_changed_under_the_same_id_fails_even_when_the_values_agree(monkeypatch):
    # The probe: loosen a contract in the registry and leave the reviewed
    # table as it is. The test fails, and so does the agreement check.
    loosened = dataclasses.replace(CONTRACTS[F32_OUTPUT], threshold=2e-4)
    monkeypatch.setitem(CONTRACTS, F32_OUTPUT, loosened)
    expected = output_like()
    with pytest.raises(AssertionError, match="a changed tolerance needs a new id"):
        assert_matches("y", expected, expected, F32_OUTPUT)
    assert [p.split(":")[0] for p in review_disagreements()] == [F32_OUTPUT]
    # Under a new id with its own reviewed line it passes.
    renamed = dataclasses.replace(loosened, id="stage.chunk_output.v2.float32.output")
    monkeypatch.setitem(CONTRACTS, renamed.id, renamed)
    monkeypatch.setitem(fingerprints.FINGERPRINTS, renamed.id, renamed.fingerprint)
    assert_matches("y", expected, expected, renamed.id)


def test_an_unknown_contract_fails():
    expected = output_like()
    with pytest.raises(AssertionError, match="no numerical contract"):
        assert_matches("y", expected, expected, "core.nothing.v1.float32.output")


def test_values_within_the_contract_pass_and_return_the_metric():
    expected = output_like()
    actual = expected * (1 + 1e-6)
    value = assert_matches("y", actual, expected, F32_OUTPUT)
    assert 0 < value <= 1e-6 * (1 + 1e-9)


def test_a_violation_names_the_worst_element_and_its_index():
    expected = output_like()
    actual = expected.copy()
    actual[1, 3, 2, 0] += 0.5  # the worst
    actual[0, 1, 1, 1] += 0.01  # also over the threshold, but smaller
    with pytest.raises(AssertionError) as failure:
        assert_matches("y", actual, expected, F32_OUTPUT)
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
        assert_matches("y", actual, expected, F32_OUTPUT)
    actual = expected.copy()
    actual[1, 2, 1, 3] += 5e-5
    assert_matches("y", actual, expected, F32_OUTPUT)


def test_max_rel_groups_the_state_by_its_own_batch_and_head_axes():
    expected = output_like(shape=(2, 3, 4, 5))  # [B, H, Dv, Dk]
    expected[1, 2] *= 0.1
    actual = expected.copy()
    actual[1, 2, 3, 4] += 5e-5
    with pytest.raises(AssertionError, match=r"index \(1, 2, 3, 4\)"):
        assert_matches("state", actual, expected, F32_STATE)


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
    assert_matches("y", actual, expected, F32_OUTPUT)
    actual[0, 4, 0, 2] = 2 * allowed
    with pytest.raises(AssertionError, match=r"index \(0, 4, 0, 2\)"):
        assert_matches("y", actual, expected, F32_OUTPUT)
    actual[0, 4, 0, 2] = 0.0
    actual[1, 4, 2, 2] += 2 * allowed
    with pytest.raises(AssertionError, match=r"index \(1, 4, 2, 2\)"):
        assert_matches("y", actual, expected, F32_OUTPUT)


def test_nan_and_inf_never_pass():
    expected = output_like()
    for bad in (np.nan, np.inf):
        actual = expected.copy()
        actual[1, 0, 2, 1] = bad
        with pytest.raises(AssertionError, match=r"index \(1, 0, 2, 1\)"):
            assert_matches("y", actual, expected, F32_OUTPUT)


def test_a_shape_mismatch_fails():
    expected = output_like()
    with pytest.raises(AssertionError, match="shape"):
        assert_matches("y", expected[:, :4], expected, F32_OUTPUT)


def test_an_exact_contract_rejects_any_difference():
    contract = CONTRACTS["core.recurrent_split.v1.any.output"]
    assert contract.metric == "max_abs" and contract.threshold == 0.0
    expected = output_like()
    assert_matches("y", expected.copy(), expected, contract.id)
    actual = expected.copy()
    actual[0, 0, 0, 0] = np.nextafter(actual[0, 0, 0, 0], np.inf)
    with pytest.raises(AssertionError, match=r"index \(0, 0, 0, 0\)"):
        assert_matches("y", actual, expected, contract.id)


def test_norm_ratio_measures_the_whole_tensor(monkeypatch):
    contract = Contract("test.norm.v1.float32.output", "norm_ratio", 1e-3, "[B,T,H,D]", 1e-2)
    monkeypatch.setitem(CONTRACTS, contract.id, contract)
    monkeypatch.setitem(fingerprints.FINGERPRINTS, contract.id, contract.fingerprint)
    expected = output_like()
    actual = expected.copy()
    # One element off by 5e-4 of the tensor's norm: the ratio is exactly that.
    actual[0, 0, 0, 0] += 5e-4 * np.linalg.norm(expected)
    value = assert_matches("y", actual, expected, contract.id)
    assert value == pytest.approx(5e-4)
    actual = expected * 1.01
    with pytest.raises(AssertionError, match="norm_ratio = 1.000e-02"):
        assert_matches("y", actual, expected, contract.id)


def test_a_norm_ratio_terms_contract_divides_by_the_larger_norm():
    contract = CONTRACTS["projection.linear.v3.float32.output"]
    assert contract.metric == "norm_ratio" and contract.magnitude == "terms"
    left, right = output_like(1, (6, 30)), output_like(2, (30, 4))
    expected = left @ right
    terms = contracts.product_terms(left, right)
    assert np.all(terms >= np.abs(expected))
    assert np.linalg.norm(terms) > 2 * np.linalg.norm(expected)  # the sums cancel
    # An error of 5e-6 of the terms' norm passes against them, and fails
    # against the result alone, less than half as large.
    actual = expected.copy()
    actual[2, 1] += 5e-6 * np.linalg.norm(terms)
    value = assert_matches("y", actual, expected, contract.id, terms=terms)
    assert value == pytest.approx(5e-6)
    with pytest.raises(AssertionError, match="norm_ratio"):
        assert_matches("y", actual, expected, contract.id, terms=np.abs(expected))
    actual[2, 1] += 1e-5 * np.linalg.norm(terms)
    with pytest.raises(AssertionError, match="norm_ratio = 1.500e-05"):
        assert_matches("y", actual, expected, contract.id, terms=terms)


def test_a_terms_contract_measures_against_the_larger_of_the_result_and_the_terms():
    contract = CONTRACTS[TERMS_OUTPUT]
    assert contract.magnitude == "terms" and contract.threshold == 1e-4
    expected = output_like()
    actual = expected.copy()
    actual[1, 2, 0, 3] += 5e-3  # 5e-3 of O(1) values: far outside 1e-4
    terms = np.ones((2, 5, 3, 1))
    with pytest.raises(AssertionError, match=r"index \(1, 2, 0, 3\)"):
        assert_matches("y", actual, expected, contract.id, terms=terms)
    # Terms of 100 in that batch row and head only: 5e-3 is within 1e-4 of
    # them, and the other groups keep their own magnitude.
    terms[1, :, 0] = 100.0
    assert_matches("y", actual, expected, contract.id, terms=terms)
    actual[0, 2, 0, 3] += 5e-3
    with pytest.raises(AssertionError, match=r"index \(0, 2, 0, 3\)"):
        assert_matches("y", actual, expected, contract.id, terms=terms)


def test_terms_are_given_exactly_to_the_contracts_that_measure_against_them():
    expected = output_like()
    terms = np.ones((2, 5, 3, 1))
    contract = CONTRACTS[TERMS_OUTPUT]
    with pytest.raises(AssertionError, match="terms were not given"):
        assert_matches("y", expected, expected, contract.id)
    with pytest.raises(AssertionError, match="terms were given"):
        assert_matches("y", expected, expected, F32_OUTPUT, terms=terms)


def one_key_channel(beta, g, tokens=4, state_scale=1e6):
    """Dk = Dv = 1, Hk = Hv = 1, B = 1: a state of `state_scale` and unit
    keys; per token the state is scaled by exp(g) (1 - beta) and gets beta v."""
    ones = np.ones((1, tokens, 1, 1))
    return dict(
        q=ones,
        k=ones,
        v=ones,
        g=np.full((1, tokens, 1), g),
        beta=np.full((1, tokens, 1), beta),
        state=np.full((1, 1, 1, 1), state_scale),
    )


def test_term_magnitudes_of_a_contracting_step():
    # beta = 1 with a unit key in one dimension replaces the state by v at
    # the first token: the result is 1, the terms the step sums are 1e6.
    arguments = one_key_channel(beta=1.0, g=0.0)
    for algorithm in ("recurrent", "chunked"):
        output_terms, state_terms = contracts.term_magnitudes(
            **arguments, algorithm=algorithm, scale=1.0
        )
        assert output_terms.shape == (1, 4, 1, 1) and state_terms.shape == (1, 5, 1)
        # No decay: an error made at the first step is carried on unshrunk.
        np.testing.assert_array_equal(state_terms[0, :, 0], 1e6)
        np.testing.assert_array_equal(output_terms[0, :, 0, 0], 1e6)


def test_term_magnitudes_shrink_with_the_decay_since_the_state_was_large():
    # A decay of e^-10 per token and beta = 0: the state is 1e6 e^(-10 t).
    # Step by step, each result's terms are the state before it; in chunks
    # of 64 every token of the first chunk is measured against its entry.
    arguments = one_key_channel(beta=0.0, g=-10.0)
    _, recurrent = contracts.term_magnitudes(**arguments, algorithm="recurrent")
    exact = 1e6 * np.exp(-10.0 * np.arange(5))
    np.testing.assert_allclose(recurrent[0, :, 0], np.concatenate([exact[:1], exact[:-1]]))
    _, chunked = contracts.term_magnitudes(**arguments, algorithm="chunked")
    np.testing.assert_array_equal(chunked[0, :, 0], 1e6)
    # A call boundary at token 2 starts a new chunk: the first call's error
    # (of its 1e6 terms) is carried into it and shrinks with each decay.
    _, split = contracts.term_magnitudes(**arguments, algorithm="chunked", call_starts=(0, 2))
    np.testing.assert_array_equal(split[0, :3, 0], 1e6)
    np.testing.assert_allclose(split[0, 3:, 0], exact[1:3])
