"""The state guard: sentinels past every output of the CPU kernels, the
forward's and the backward's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import _ext

SENTINEL = 73.25


def run_core_guarded(
    q,
    k,
    v,
    g,
    beta,
    state,
    *,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
    algorithm="auto",
    sentinel=SENTINEL,
):
    """Runs the CPU kernel on outputs padded with ``sentinel`` values.

    NumPy (or mlx) in, NumPy out: ``(y, state, y_tail, state_tail)``; the tails
    are the words past the end of each output and must still equal ``sentinel``
    (y's guard holds the sentinel rounded to y's dtype: 73.25 is 73.0 in bf16).
    """
    q, k, v, g, beta, state, mask = as_mlx(q, k, v, g, beta, state, mask)
    outputs = _ext.run_core_guarded(
        q,
        k,
        v,
        g,
        beta,
        state,
        mask,
        None if scale is None else float(scale),
        head_mapping,
        bool(normalize_qk),
        algorithm,
        float(sentinel),
    )
    return tuple(as_numpy(x) for x in outputs)


def run_core_backward_guarded(
    q,
    k,
    v,
    g,
    beta,
    state,
    y_cotangent,
    state_cotangent,
    *,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
    algorithm="auto",
    sentinel=SENTINEL,
):
    """Runs the CPU backward on gradients padded with ``sentinel`` values,
    for the cotangents of y and of the final state.

    Returns ``(gradients, tails)``, dicts of NumPy arrays by gradient name
    (``dq``, ``dk``, ``dv``, ``dg``, ``dgamma``, ``dbeta``, ``dstate``): the
    gradients, and the words past the end of each, which must still equal
    ``sentinel`` (in the activation dtype for dq, dk and dv).
    """
    q, k, v, g, beta, state, mask, y_cotangent, state_cotangent = as_mlx(
        q, k, v, g, beta, state, mask, y_cotangent, state_cotangent
    )
    gradients, tails = _ext.run_core_backward_guarded(
        q,
        k,
        v,
        g,
        beta,
        state,
        y_cotangent,
        state_cotangent,
        mask,
        None if scale is None else float(scale),
        head_mapping,
        bool(normalize_qk),
        algorithm,
        float(sentinel),
    )
    return (
        {name: as_numpy(x) for name, x in gradients.items()},
        {name: as_numpy(x) for name, x in tails.items()},
    )


def as_mlx(*arrays):
    return tuple(
        x if x is None or isinstance(x, mx.array) else mx.array(np.asarray(x)) for x in arrays
    )


def as_numpy(x):
    return np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)
