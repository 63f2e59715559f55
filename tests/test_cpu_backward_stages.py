"""Every stage of the CPU chunked backward against its namesake in the
float64 reference (`reference.chunked_backward_stages`; docs/stages.md,
"Backward: the core recurrence"): a wrong stage fails under its own name,
where the op's gradients would only say that some stage is wrong.

The CPU kernel records what each stage leaves, chunk by chunk, when traced
(`_ext.trace_cpu_chunked_backward_stages`, the same pipeline with a trace):
dV', dq and dk of chunk_output_backward; dV', dW, dq and dk after
chunk_carry_backward; dT, dk and dbeta after recompute_w_u_backward; dk and
dbeta after kkt_inverse_backward; dg of gate_cumsum_backward. Both kinds
of gates (scalar, and per key channel against
`reference.per_key_chunked_backward_stages`), without wipes (a chunk with a
wipe runs the recurrent reverse, which the stages do not trace), masked
tokens and a partial last chunk. Rows (and dT's columns) past the last
token are padding no stage defines, and the CPU leaves a masked token's
dbeta and dg at 0 where the reference's stages still carry terms the op
discards: those entries are taken from the reference.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import _ext, reference
from mlx_gated_delta.testing.contracts import assert_matches

# Two value heads on one key head, 150 tokens: two full chunks and a
# partial one.
TOKENS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 150, 2, 32, 16
CHUNK = reference.CHUNK_SIZE

# The stage outputs by name, and the kind of gradient contract each is held
# to (core_grad.oracle.v1.float32.*, norm-wise).
STAGES = {
    "output_d_corrected": "activation_grad",
    "output_dq": "activation_grad",
    "output_dk": "activation_grad",
    "carry_d_corrected": "activation_grad",
    "carry_dw": "activation_grad",
    "carry_dq": "activation_grad",
    "carry_dk": "activation_grad",
    "w_u_dt": "activation_grad",
    "w_u_dk": "activation_grad",
    "w_u_dbeta": "gate_grad",
    "kkt_dk": "activation_grad",
    "kkt_dbeta": "gate_grad",
    "dg": "gate_grad",
}
# Per token: a masked token's value is the reference's (see the top).
PER_TOKEN = ("w_u_dbeta", "kkt_dbeta", "dg")


@pytest.fixture(scope="module", params=["scalar", "per_key"])
def inputs(request):
    rng = np.random.default_rng(0)
    f32 = np.float32
    q = rng.standard_normal((1, TOKENS, 1, KEY_DIM)).astype(f32)
    k = rng.standard_normal((1, TOKENS, 1, KEY_DIM)).astype(f32)
    v = rng.standard_normal((1, TOKENS, VALUE_HEADS, VALUE_DIM)).astype(f32)
    if request.param == "scalar":
        g = -rng.uniform(0.0, 1.0, (1, TOKENS, VALUE_HEADS)).astype(f32)
    else:
        # Gentler per channel, so that a chunk's decays still span a few
        # orders of magnitude rather than underflowing in most channels.
        g = -rng.uniform(0.0, 0.3, (1, TOKENS, VALUE_HEADS, KEY_DIM)).astype(f32)
    beta = rng.uniform(0.0, 1.0, (1, TOKENS, VALUE_HEADS)).astype(f32)
    state = (0.5 * rng.standard_normal((1, VALUE_HEADS, VALUE_DIM, KEY_DIM))).astype(f32)
    dy = rng.standard_normal((1, TOKENS, VALUE_HEADS, VALUE_DIM)).astype(f32)
    d_state = rng.standard_normal((1, VALUE_HEADS, VALUE_DIM, KEY_DIM)).astype(f32)
    mask = rng.uniform(size=(1, TOKENS)) > 0.2
    return q, k, v, g, beta, state, dy, d_state, mask


@pytest.fixture(scope="module")
def expected(inputs):
    q, k, v, g, beta, state, dy, d_state, mask = inputs
    stages = (
        reference.per_key_chunked_backward_stages
        if g.ndim == 4
        else reference.chunked_backward_stages
    )
    return stages(
        q,
        k,
        v,
        g,
        beta,
        state,
        y_cotangent=dy,
        state_cotangent=d_state,
        mask=mask,
        normalize_qk=True,
    )


@pytest.fixture(scope="module", params=range(VALUE_HEADS), ids=lambda h: f"head{h}")
def traced(request, inputs):
    head = request.param
    arrays = [mx.array(x) for x in inputs]
    out = _ext.trace_cpu_chunked_backward_stages(*arrays, KEY_DIM**-0.5, "grouped", True, 0, head)
    return head, {name: np.array(value) for name, value in out.items()}


@pytest.mark.parametrize("name", STAGES)
def test_cpu_backward_stage_matches_the_reference(name, traced, expected, inputs):
    head, cpu = traced
    want = expected[name][0, head]  # [C, L, ...]
    got = cpu[name].astype(np.float64)
    assert got.shape == want.shape, name
    # The padding past the last token (rows, and dT's columns).
    rows = np.arange(want.shape[0] * CHUNK).reshape(want.shape[:2]) < TOKENS
    if name in PER_TOKEN:
        mask = inputs[-1][0]
        rows &= np.pad(mask, (0, rows.size - TOKENS)).reshape(rows.shape)
    keep = rows.reshape(rows.shape + (1,) * (want.ndim - 2))
    if name == "w_u_dt":
        keep = keep & rows[:, None, :]
    got = np.where(keep, got, want)
    # The stage ran: it is not the reference's padding alone.
    assert np.any(got[np.broadcast_to(keep, got.shape)] != 0.0), name
    assert_matches(name, got, want, f"core_grad.oracle.v1.float32.{STAGES[name]}")
