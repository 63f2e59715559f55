"""The fuzz (`python -m mlx_gated_delta fuzz`) in a small form, and probes
showing that each of its checks catches what it is for."""

import os

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta.__main__ import main
from mlx_gated_delta.testing.fuzz import FAILURES, Fuzzer

CALLS = int(os.environ.get("MLX_GATED_DELTA_FUZZ_CALLS", "300"))


@pytest.mark.fuzz
def test_fuzz_finds_no_failure():
    fuzzer = Fuzzer(seed=12345)
    totals = fuzzer.run(CALLS)
    assert sum(totals.values()) == CALLS
    assert totals["ok"] > CALLS // 3 and totals["rejected"] > CALLS // 10
    assert not any(totals[o] for o in FAILURES), fuzzer.table() + f"\n{fuzzer.examples}"


def test_a_nan_in_an_unrelated_row_or_head_is_a_leak():
    clean = mx.zeros((2, 3, 4, 5))
    # Head 1 of row 0 was poisoned: its NaN is allowed, one in row 1 is not.
    allowed = clean.at[0, :, 1].add(mx.nan)
    assert Fuzzer.leak_between(allowed, clean, 0, [1], head_axis=2) == ""
    assert Fuzzer.leak_between(allowed.at[1, 2, 3, 4].add(mx.inf), clean, 0, [1], 2)
    # Another head of the poisoned row.
    assert Fuzzer.leak_between(allowed.at[0, 0, 2, 0].add(mx.nan), clean, 0, [1], 2)
    # No head given (the segment): the whole poisoned row is allowed.
    assert Fuzzer.leak_between(clean.at[0].add(mx.nan), clean, 0, None, 2) == ""
    # A slice that is not finite without the poison either is no leak.
    assert Fuzzer.leak_between(clean.at[1].add(mx.nan), clean.at[1].add(mx.nan), 0, None, 2) == ""


def test_rejections_are_classified_by_the_argument_they_name():
    fuzzer = Fuzzer(seed=0)
    named = ValueError("state must have shape (1, 2, 3, 4) [B, Hv, Dv, Dk], got (1,)")
    assert fuzzer.rejection("gated_delta_rule", named, "state") == ("rejected", "")
    unnamed = ValueError("shapes do not match")
    assert fuzzer.rejection("gated_delta_rule", unnamed, "state")[0] == "unnamed_rejection"
    # A word that merely contains an argument's name is not the name.
    assert (
        fuzzer.rejection("gated_delta_rule", ValueError("kv mismatch"), "k")[0]
        == "unnamed_rejection"
    )
    # Valid arguments rejected: a crash, however clear the message.
    assert fuzzer.rejection("gated_delta_rule", named, None)[0] == "crash"


def test_the_command_prints_the_counts_table(capsys):
    assert main(["fuzz", "--calls", "30", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "fuzz: 30 calls, seed 7" in out and "fuzz PASS: 0 failures" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("gated_", "vjp("))]
    assert [row[0] for row in rows] == [
        "gated_delta_rule",
        "gated_delta_update",
        "gated_delta_segment",
        "vjp(gated_delta_rule)",
        "vjp(gated_delta_update)",
        "vjp(gated_delta_segment)",
    ]
    assert sum(int(row[1]) + int(row[2]) for row in rows) == 30


def test_a_gradient_of_the_wrong_shape_or_dtype_is_a_bad_result():
    arguments = {"q": mx.zeros((1, 2, 3, 4)), "v": mx.zeros((1, 2, 3, 5), dtype=mx.bfloat16)}
    right = [mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 5), dtype=mx.bfloat16)]
    assert Fuzzer.gradient_failure(["q", "v"], right, arguments) == ""
    wrong_dtype = [right[0], right[1].astype(mx.float32)]
    assert "gradient of v" in Fuzzer.gradient_failure(["q", "v"], wrong_dtype, arguments)
    wrong_shape = [mx.zeros((1, 2, 3, 1)), right[1]]
    assert "gradient of q" in Fuzzer.gradient_failure(["q", "v"], wrong_shape, arguments)


def test_a_changed_word_past_an_output_is_an_overwrite():
    # The guards' verdict: every tail must hold the sentinel, in the
    # activation dtype for the activations (73.25 is 73.0 in bfloat16).
    from mlx_gated_delta.testing.guarded import SENTINEL

    tails = {"dq": np.full(16, 73.0), "dstate": np.full(16, SENTINEL)}
    assert Fuzzer.overwritten(tails, mx.bfloat16, ("dq",)) == ""
    tails["dstate"][15] = 0.5
    assert Fuzzer.overwritten(tails, mx.bfloat16, ("dq",)).startswith("dstate tail")
    # The same words read in float32: dq's 73.0 is not the sentinel there.
    assert "dq tail" in Fuzzer.overwritten(tails, mx.float32, ("dq",))
