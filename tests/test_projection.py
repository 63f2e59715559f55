"""The layer's dense CPU projection `x @ weight.T` against float64, over the
shapes that exercise both paths (few rows: dot products; many: blocked GEMM)
and every tile tail."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_gated_delta import _ext
from mlx_gated_delta.reference import to_float64
from mlx_gated_delta.testing.contracts import assert_matches, product_terms
from mlx_gated_delta.testing.strategies import DTYPES  # also loads the profiles


@given(
    seed=st.integers(0, 2**32 - 1),
    leading=st.sampled_from([(1,), (3,), (2, 15), (31,), (32,), (1, 70), (129,)]),
    in_features=st.sampled_from([1, 5, 64, 255, 256, 257, 600]),
    out_features=st.sampled_from([1, 7, 32, 127, 128, 129, 300]),
    dtype=st.sampled_from(tuple(DTYPES)),
)
def test_dense_projection_matches_float64(seed, leading, in_features, out_features, dtype):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((*leading, in_features)).astype(np.float32))
    weight = mx.array(
        (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)
    )
    x, weight = x.astype(DTYPES[dtype]), weight.astype(DTYPES[dtype])
    y = _ext.dense_projection(x, weight, None)
    assert y.shape == (*leading, out_features) and y.dtype == x.dtype
    expected = to_float64(x) @ to_float64(weight).T
    contract = f"projection.linear.v3.{dtype}.output"
    assert_matches("y", y, expected, contract, terms=product_terms(x, to_float64(weight).T))


def test_dense_projection_reads_strided_inputs():
    x = mx.random.normal((6, 40))[:, ::2]  # a non-contiguous view
    weight = mx.random.normal((20, 30)).T  # a transposed view, [30, 20]
    expected = to_float64(x) @ to_float64(weight).T
    terms = product_terms(x, to_float64(weight).T)
    contract = "projection.linear.v3.float32.output"
    assert_matches("y", _ext.dense_projection(x, weight, None), expected, contract, terms=terms)


@pytest.mark.parametrize("out_features", [64, 32])
def test_dense_projection_rows_do_not_depend_on_how_many_come_with_them(out_features):
    """With more rows than W, the GEMM computes y^T = W x^T (widening the
    smaller operand), also for a W of fewer rows than the dot products take
    (Qwen3.5's b and a): each row's bits are those of the same row projected
    in a call of fewer rows (48 to 64, from as many as W's: y = x W^T)."""
    x = mx.random.normal((200, 300), key=mx.random.key(4)).astype(mx.bfloat16)
    weight = mx.random.normal((out_features, 300), key=mx.random.key(5)).astype(mx.bfloat16)
    y = _ext.dense_projection(x, weight, None)
    for start, stop in ((0, 64), (64, 128), (128, 176)):
        part = _ext.dense_projection(x[start:stop], weight, None)
        assert mx.array_equal(y[start:stop], part).item(), (start, stop)


def _projection_vjp(x, weight, dy):
    _, (dx, dw) = mx.vjp(lambda a, w: _ext.dense_projection(a, w, None), [x, weight], [dy])
    return dx, dw


@given(
    seed=st.integers(0, 2**32 - 1),
    leading=st.sampled_from([(1,), (3,), (2, 15), (47,), (48,), (1, 70), (129,)]),
    in_features=st.sampled_from([1, 5, 64, 257]),
    out_features=st.sampled_from([1, 7, 47, 48, 129, 300]),
    dtype=st.sampled_from(tuple(DTYPES)),
)
def test_dense_projection_vjp_matches_float64(seed, leading, in_features, out_features, dtype):
    """dx = dy W and dW = dy^T x, which the vjp reads through transposed
    views of dy, x and W: both the dot products (fewer than 48 rows) and the
    blocked GEMM, each operand row-major or transposed."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((*leading, in_features)).astype(np.float32))
    weight = mx.array(
        (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)
    )
    dy = mx.array(rng.standard_normal((*leading, out_features)).astype(np.float32))
    x, weight, dy = (a.astype(DTYPES[dtype]) for a in (x, weight, dy))
    dx, dw = _projection_vjp(x, weight, dy)
    assert dx.shape == x.shape and dw.shape == weight.shape
    rows_x = to_float64(x).reshape(-1, in_features)
    rows_dy = to_float64(dy).reshape(-1, out_features)
    contract = f"projection.linear.v3.{dtype}.output"
    dx_terms = product_terms(rows_dy, weight).reshape(x.shape)
    expected_dx = (rows_dy @ to_float64(weight)).reshape(x.shape)
    assert_matches("dx", dx, expected_dx, contract, terms=dx_terms)
    assert_matches("dW", dw, rows_dy.T @ rows_x, contract, terms=product_terms(rows_dy.T, rows_x))


@pytest.mark.parametrize("rows", [5, 300])
def test_dense_projection_vjp_equals_the_product_of_copied_transposes(rows):
    """Reading dy^T, x^T and W^T through their strides gives the bits of the
    product of their row-major copies (what the vjp computed before it read
    views): the same sums in the same order."""
    x = mx.random.normal((rows, 70), key=mx.random.key(1)).astype(mx.bfloat16)
    weight = mx.random.normal((130, 70), key=mx.random.key(2)).astype(mx.bfloat16)
    dy = mx.random.normal((rows, 130), key=mx.random.key(3)).astype(mx.bfloat16)
    dx, dw = _projection_vjp(x, weight, dy)
    copied_w_t = mx.array(np.ascontiguousarray(np.array(weight.astype(mx.float32)).T))
    copied_dy_t = mx.array(np.ascontiguousarray(np.array(dy.astype(mx.float32)).T))
    copied_x_t = mx.array(np.ascontiguousarray(np.array(x.astype(mx.float32)).T))
    expected_dx = _ext.dense_projection(dy, copied_w_t.astype(mx.bfloat16), None)
    expected_dw = _ext.dense_projection(
        copied_dy_t.astype(mx.bfloat16), copied_x_t.astype(mx.bfloat16), None
    )
    assert mx.array_equal(dx, expected_dx).item()
    assert mx.array_equal(dw, expected_dw).item()


@pytest.mark.parametrize(
    "x, weight, error, words",
    [
        (mx.zeros((2, 4)), mx.zeros((3, 5)), ValueError, ["x in = 4", "weight in = 5"]),
        (mx.zeros((2, 4)), mx.zeros((4,)), ValueError, ["weight of rank 1"]),
        (mx.zeros((2, 4)), mx.zeros((3, 4), dtype=mx.float16), TypeError, ["float16"]),
        (mx.zeros((2, 4), dtype=mx.int32), mx.zeros((3, 4), dtype=mx.int32), TypeError, ["int32"]),
    ],
)
def test_dense_projection_rejects_mismatched_inputs(x, weight, error, words):
    with pytest.raises(error) as raised:
        _ext.dense_projection(x, weight, None)
    for word in words:
        assert word in str(raised.value)


# Pairs for dense_projection_row: each takes x itself or a [.., in] input of
# its own (the low-rank gates' second factor), and its own output width.
@st.composite
def projection_rows(draw):
    leading = draw(st.sampled_from([(1,), (3,), (2, 15), (47,), (48,), (1, 70), (129,)]))
    dtype = draw(st.sampled_from(tuple(DTYPES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def array(shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(
            DTYPES[dtype]
        )

    x = array((*leading, draw(st.sampled_from([1, 5, 64, 257]))))
    xs, weights = [], []
    for _ in range(draw(st.integers(1, 4))):
        own_input = draw(st.booleans())
        x_pair = array((*leading, draw(st.sampled_from([3, 16])))) if own_input else x
        out_features = draw(st.sampled_from([1, 7, 48, 129]))
        in_features = x_pair.shape[-1]
        xs.append(x_pair)
        weights.append(array((out_features, in_features), in_features**-0.5))
    return xs, weights


def _row_vjp(project, xs, weights, dy):
    n = len(xs)
    _, grads = mx.vjp(lambda *a: project(list(a[:n]), list(a[n:])), [*xs, *weights], [dy])
    return grads


def _concatenated(xs, weights):
    return mx.concatenate([_ext.dense_projection(x, w, None) for x, w in zip(xs, weights)], -1)


def _row(xs, weights):
    return _ext.dense_projection_row(xs, weights, None)


@given(case=projection_rows(), seed=st.integers(0, 2**32 - 1))
def test_dense_projection_row_is_the_concatenation_bit_for_bit(case, seed):
    """Each pair's columns are written where concatenation would copy them,
    from the same sums (dots or blocked GEMM, with the same operands), so
    the row and every gradient are the bits of projecting each pair alone
    and concatenating; those are held to float64 by the tests above. A pair
    reading the same x as another gets its own dx, summed by MLX as for
    separate projections."""
    xs, weights = case
    row = _row(xs, weights)
    expected = _concatenated(xs, weights)
    assert row.shape == expected.shape and row.dtype == expected.dtype
    assert mx.array_equal(row, expected).item()
    dy = mx.random.normal(row.shape, key=mx.random.key(seed % 2**31)).astype(row.dtype)
    grads = _row_vjp(_row, xs, weights, dy)
    expected_grads = _row_vjp(_concatenated, xs, weights, dy)
    for i, (grad, expected_grad) in enumerate(zip(grads, expected_grads)):
        assert grad.shape == expected_grad.shape, i
        assert mx.array_equal(grad, expected_grad).item(), i


@pytest.mark.parametrize(
    "xs, weights, error, words",
    [
        ([], [], ValueError, ["at least one pair", "0 x and 0 weights"]),
        ([mx.zeros((2, 4))], [], ValueError, ["1 x and 0 weights"]),
        (
            [mx.zeros((2, 4)), mx.zeros((3, 4))],
            [mx.zeros((5, 4)), mx.zeros((5, 4))],
            ValueError,
            ["pair 1", "leading shape (3,)", "pair 0's (2,)"],
        ),
        (
            [mx.zeros((2, 4)), mx.zeros((2, 6))],
            [mx.zeros((5, 4)), mx.zeros((5, 4))],
            ValueError,
            ["pair 1", "x in = 6", "weight in = 4"],
        ),
        (
            [mx.zeros((2, 4)), mx.zeros((2, 4), dtype=mx.float16)],
            [mx.zeros((5, 4)), mx.zeros((5, 4), dtype=mx.float16)],
            TypeError,
            ["pair 1", "pair 0's x (float32)", "float16"],
        ),
    ],
)
def test_dense_projection_row_rejects_mismatched_pairs(xs, weights, error, words):
    with pytest.raises(error) as raised:
        _ext.dense_projection_row(xs, weights, None)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize(
    "x_shape, out_features", [((2, 0), 3), ((0, 4), 3), ((2, 3, 0), 5), ((2, 4), 0)]
)
def test_dense_projection_of_empty_operands_is_matmuls(x_shape, out_features):
    """No rows, no outputs, or an empty sum (in = 0: zeros, as MLX's matmul
    gives them), forward and vjp; once an in = 0 call divided by zero."""
    x = mx.ones(x_shape)
    weight = mx.ones((out_features, x_shape[-1]))
    dy = mx.ones((*x_shape[:-1], out_features))
    y = _ext.dense_projection(x, weight, None)
    assert mx.array_equal(y, x @ weight.T).item() and y.shape == dy.shape
    dx, dw = _projection_vjp(x, weight, dy)
    assert mx.array_equal(dx, dy @ weight).item() and dx.shape == x.shape
    rows = int(np.prod(x_shape[:-1]))
    expected_dw = dy.reshape(rows, out_features).T @ x.reshape(rows, x_shape[-1])
    assert mx.array_equal(dw, expected_dw).item() and dw.shape == weight.shape
