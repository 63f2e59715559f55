"""Bad input gets a clear error at call time (docs/contract.md).

Each case checks the exception type and that the message names the argument,
what was expected and what was given.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import gated_delta_rule, gated_delta_update

# Distinct sizes, so a shape in a message can only be the one meant.
B, T, HK, HV, DK, DV = 2, 3, 2, 4, 16, 8


def good_inputs():
    return dict(
        q=mx.zeros((B, T, HK, DK)),
        k=mx.zeros((B, T, HK, DK)),
        v=mx.zeros((B, T, HV, DV)),
        g=mx.zeros((B, T, HV)),
        beta=mx.zeros((B, T, HV)),
    )


def call_rule(**changes):
    arguments = {**good_inputs(), **changes}
    return lambda: gated_delta_rule(**arguments)


def call_update(**changes):
    arguments = {**good_inputs(), **changes}
    arguments["gamma"] = arguments.pop("g")
    return lambda: gated_delta_update(**arguments)


def shape(*dims):
    """A regex for a whole shape printed as a tuple or a list: (2, 3), [2, 3]."""
    return r"[\(\[]\s*" + r"\s*,\s*".join(str(d) for d in dims) + r"\s*,?\s*[\)\]]"


def word(name):
    return rf"(?<![\w.]){re.escape(name)}(?!\w)"


BAD_INPUTS = [
    # (id, call, exception, [regexes the message must contain: argument,
    #  expected, actual], optionally a mark)
    (
        "q rank 3",
        call_rule(q=mx.zeros((B, T, 32))),
        ValueError,
        [word("q"), re.escape("[B, T, Hk, Dk]"), shape(B, T, 32)],
    ),
    (
        "k rank 5",
        call_rule(k=mx.zeros((B, T, HK, DK, 1))),
        ValueError,
        [word("k"), re.escape("[B, T, Hk, Dk]"), shape(B, T, HK, DK, 1)],
    ),
    (
        "v rank 3",
        call_rule(v=mx.zeros((B, T, HV * DV))),
        ValueError,
        [word("v"), re.escape("[B, T, Hv, Dv]"), shape(B, T, HV * DV)],
    ),
    (
        "g rank 2",
        call_rule(g=mx.zeros((B, T))),
        ValueError,
        [word("g"), shape(B, T, HV), shape(B, T)],
    ),
    (
        "beta rank 4",
        call_rule(beta=mx.zeros((B, T, HV, 1))),
        ValueError,
        [word("beta"), shape(B, T, HV), shape(B, T, HV, 1)],
    ),
    (
        "value heads not a multiple of key heads",
        call_rule(v=mx.zeros((B, T, 3, DV)), g=mx.zeros((B, T, 3)), beta=mx.zeros((B, T, 3))),
        ValueError,
        [r"value heads", r"key heads", r"\b3\b", r"\b2\b"],
    ),
    (
        "k batch differs from q",
        call_rule(k=mx.zeros((1, T, HK, DK))),
        ValueError,
        [word("k"), shape(B, T, HK, DK), shape(1, T, HK, DK)],
    ),
    (
        "k tokens differ from q",
        call_rule(k=mx.zeros((B, 5, HK, DK))),
        ValueError,
        [word("k"), shape(B, T, HK, DK), shape(B, 5, HK, DK)],
    ),
    (
        "k key dim differs from q",
        call_rule(k=mx.zeros((B, T, HK, 32))),
        ValueError,
        [word("k"), shape(B, T, HK, DK), shape(B, T, HK, 32)],
    ),
    (
        "v batch differs from q",
        call_rule(v=mx.zeros((1, T, HV, DV))),
        ValueError,
        [word("v"), shape(B, T, HV, DV), shape(1, T, HV, DV)],
    ),
    (
        "state of the wrong shape",
        call_rule(state=mx.zeros((B, HV, DK, DV))),
        ValueError,
        [word("state"), shape(B, HV, DV, DK), shape(B, HV, DK, DV)],
    ),
    (
        "state of the wrong dtype",
        call_rule(state=mx.zeros((B, HV, DV, DK), dtype=mx.bfloat16)),
        TypeError,
        [word("state"), "float32", "bfloat16"],
    ),
    (
        "unknown head_mapping",
        lambda: gated_delta_rule(**good_inputs(), head_mapping="tiled"),
        ValueError,
        [word("head_mapping"), "grouped", "interleaved", "tiled"],
    ),
    (
        "unknown algorithm",
        lambda: gated_delta_rule(**good_inputs(), algorithm="fastest"),
        ValueError,
        [word("algorithm"), "recurrent", "chunked", "auto", "fastest"],
    ),
    (
        "mask of the wrong shape",
        call_rule(mask=mx.ones((B, T + 1), dtype=mx.bool_)),
        ValueError,
        [word("mask"), shape(B, T), shape(B, T + 1)],
    ),
    (
        "mask of the wrong dtype",
        call_rule(mask=mx.ones((B, T))),
        TypeError,
        [word("mask"), "bool", "float32"],
    ),
    (
        "integer activations",
        call_rule(q=mx.zeros((B, T, HK, DK), dtype=mx.int32)),
        TypeError,
        [word("q"), "float32", "int32"],
    ),
    (
        "activations of mixed dtypes",
        call_rule(v=mx.zeros((B, T, HV, DV), dtype=mx.float16)),
        TypeError,
        [word("v"), "float16", "float32"],
    ),
    (
        "k of another dtype",
        call_rule(k=mx.zeros((B, T, HK, DK), dtype=mx.bfloat16)),
        TypeError,
        [word("k"), "bfloat16", "float32"],
    ),
    (
        "integer decay",
        call_rule(g=mx.zeros((B, T, HV), dtype=mx.int32)),
        TypeError,
        [word("g"), "float", "int32"],
    ),
    (
        "a NumPy array for q",
        call_rule(q=np.zeros((B, T, HK, DK), dtype=np.float32)),
        TypeError,
        [word("q"), "mlx", "ndarray"],
    ),
    (
        "a non-string head_mapping",
        lambda: gated_delta_rule(**good_inputs(), head_mapping=1),
        TypeError,
        [word("head_mapping"), "str", "int"],
    ),
    # Per-key-channel gates are [B, T, Hv, Dk]: a last axis other than Dk is
    # named with both accepted layouts.
    (
        "per-key g with the wrong key dim",
        call_rule(g=mx.zeros((B, T, HV, DK + 1))),
        ValueError,
        [word("g"), re.escape("[B, T, Hv, Dk]"), shape(B, T, HV, DK), shape(B, T, HV, DK + 1)],
    ),
    (
        "per-key gamma with the wrong key dim",
        call_update(g=mx.ones((B, T, HV, 1))),
        ValueError,
        [word("gamma"), re.escape("[B, T, Hv, Dk]"), shape(B, T, HV, DK), shape(B, T, HV, 1)],
    ),
    (
        "g of rank 5",
        call_rule(g=mx.zeros((B, T, HV, DK, 1))),
        ValueError,
        [word("g"), re.escape("[B, T, Hv]"), re.escape("[B, T, Hv, Dk]"), shape(B, T, HV, DK, 1)],
    ),
    (
        "update: initial_state of the wrong shape",
        call_update(initial_state=mx.zeros((1, HV, DV, DK))),
        ValueError,
        [word("initial_state"), shape(B, HV, DV, DK), shape(1, HV, DV, DK)],
    ),
    (
        "update: gamma of the wrong rank",
        call_update(g=mx.ones((B, T))),
        ValueError,
        [word("gamma"), shape(B, T, HV), shape(B, T)],
    ),
    (
        "update: mask of the wrong shape",
        call_update(mask=mx.ones((B,), dtype=mx.bool_)),
        ValueError,
        [word("mask"), shape(B, T), shape(B)],
    ),
    # Zero-size B, T, Hv and Dv give empty results (mlx_gated_delta/tests/test_core.py); a zero
    # key dim or no key head is named as such, not as a symptom of it (an
    # infinite default scale, a head count that does not divide).
    (
        "key dim of zero",
        call_rule(q=mx.zeros((B, T, HK, 0)), k=mx.zeros((B, T, HK, 0))),
        ValueError,
        [word("q"), r"key dim", r"Dk >= 1", shape(B, T, HK, 0)],
    ),
    (
        "key dim of zero, explicit scale",
        lambda: gated_delta_rule(
            **{**good_inputs(), "q": mx.zeros((B, T, HK, 0)), "k": mx.zeros((B, T, HK, 0))},
            scale=1.0,
        ),
        ValueError,
        [word("q"), r"key dim", shape(B, T, HK, 0)],
    ),
    (
        "update: key dim of zero",
        call_update(q=mx.zeros((B, T, HK, 0)), k=mx.zeros((B, T, HK, 0))),
        ValueError,
        [word("q"), r"key dim", shape(B, T, HK, 0)],
    ),
    (
        "no key heads",
        call_rule(q=mx.zeros((B, T, 0, DK)), k=mx.zeros((B, T, 0, DK))),
        ValueError,
        [word("q"), r"key head", r"Hk >= 1", shape(B, T, 0, DK)],
    ),
    (
        "no key heads and no value heads",
        call_rule(
            q=mx.zeros((B, T, 0, DK)),
            k=mx.zeros((B, T, 0, DK)),
            v=mx.zeros((B, T, 0, DV)),
            g=mx.zeros((B, T, 0)),
            beta=mx.zeros((B, T, 0)),
        ),
        ValueError,
        [word("q"), r"key head", shape(B, T, 0, DK)],
    ),
]


def test_every_message_starts_with_the_argument_it_is_about():
    # What a user reads first: the message opens with the argument's name
    # (or, for the head counts, the two quantities that disagree).
    for case_id, call, exception, fragments, *_ in BAD_INPUTS:
        with pytest.raises(exception) as failure:
            call()
        first_word = re.match(r"[\w.]+", str(failure.value)).group(0)
        assert re.fullmatch(fragments[0], first_word) or case_id.startswith("value heads"), (
            f"{case_id}: the message opens with {first_word!r}: {failure.value}"
        )


@pytest.mark.parametrize(
    "call, exception, fragments",
    [pytest.param(*case[1:4], id=case[0], marks=case[4:]) for case in BAD_INPUTS],
)
def test_bad_input_gets_a_clear_error(call, exception, fragments):
    with pytest.raises(exception) as failure:
        call()
    message = str(failure.value)
    for fragment in fragments:
        assert re.search(fragment, message), f"{fragment!r} not in {message!r}"


# Lazily created inputs whose element counts overflow a 32-bit kernel index:
# mx.zeros builds a graph node; nothing is allocated until it is evaluated.
HUGE_TOKENS = 2**22


def huge_qk_call():
    q = mx.zeros((1, HUGE_TOKENS, 16, 128))  # 2^33 elements
    v = mx.zeros((1, HUGE_TOKENS, 16, 1))
    g = mx.zeros((1, HUGE_TOKENS, 16))
    return lambda: gated_delta_rule(q, q, v, g, g)


def huge_v_call():
    q = mx.zeros((1, HUGE_TOKENS, 1, 16))
    v = mx.zeros((1, HUGE_TOKENS, 16, 128))  # 2^33 elements
    g = mx.zeros((1, HUGE_TOKENS, 16))
    return lambda: gated_delta_rule(q, q, v, g, g)


def huge_state_call():
    # One token, but a [1, 1024, 2048, 2048] state: 2^32 elements.
    q = mx.zeros((1, 1, 1, 2048))
    v = mx.zeros((1, 1, 1024, 2048))
    g = mx.zeros((1, 1, 1024))
    return lambda: gated_delta_rule(q, q, v, g, g)


def huge_update_call():
    q = mx.zeros((1, HUGE_TOKENS, 16, 128))
    v = mx.zeros((1, HUGE_TOKENS, 16, 1))
    gamma = mx.ones((1, HUGE_TOKENS, 16))
    return lambda: gated_delta_update(q, q, v, gamma, gamma)


@pytest.mark.parametrize(
    "make_call, tensor",
    [
        (huge_qk_call, "QK activation elements"),
        (huge_v_call, "V activation elements"),
        (huge_state_call, "state elements"),
        (huge_update_call, "QK activation elements"),
    ],
    ids=["q and k", "v", "state", "gated_delta_update"],
)
def test_huge_lazy_inputs_are_rejected_at_call_time_without_allocating(make_call, tensor):
    call = make_call()
    mx.reset_peak_memory()
    active_before = mx.get_active_memory()
    with pytest.raises(ValueError) as failure:
        call()  # no mx.eval: the op itself must refuse
    assert tensor in str(failure.value)
    assert str(2**32 - 1) in str(failure.value) or "32-bit" in str(failure.value)
    # Nothing of the 32+ GiB inputs was materialised.
    assert mx.get_peak_memory() - active_before < 2**26
