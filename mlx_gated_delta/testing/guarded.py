"""The state guard: sentinels past every output."""

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
    q, k, v, g, beta, state = (
        mx.array(np.asarray(x)) if not isinstance(x, mx.array) else x
        for x in (q, k, v, g, beta, state)
    )
    if mask is not None and not isinstance(mask, mx.array):
        mask = mx.array(np.asarray(mask))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    outputs = _ext.run_core_guarded(
        q,
        k,
        v,
        g,
        beta,
        state,
        mask,
        float(scale),
        head_mapping,
        bool(normalize_qk),
        algorithm,
        float(sentinel),
    )
    return tuple(np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x) for x in outputs)
