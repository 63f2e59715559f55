"""The core op (docs/contract.md)."""

from __future__ import annotations

import mlx.core as mx

from . import _ext

StreamOrDevice = None | mx.Stream | mx.Device


def _require_array(name: str, value) -> None:
    if not isinstance(value, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(value).__name__}")


def _index_array(name, values, what):
    """A list of ints (``checkpoints``, ``parents``) as an integer array for
    the C++ checks, which own the rules on its shape and values."""
    if values is None or isinstance(values, mx.array):
        return values
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"{name} must be a list of ints or a 1-D integer mlx.core.array, "
            f"got {type(values).__name__}"
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must hold ints ({what}), got {value!r}")
    return mx.array(list(values), dtype=mx.int64)


def _checkpoints_array(checkpoints):
    return _index_array("checkpoints", checkpoints, "token counts")


def _check_core_arguments(q, k, v, beta, mask) -> None:
    for name, value in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        _require_array(name, value)
    if mask is not None:
        _require_array("mask", mask)


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    *,
    scale: float | None = None,
    head_mapping: str = "grouped",
    mask: mx.array | None = None,
    normalize_qk: bool = False,
    algorithm: str = "auto",
    checkpoints=None,
    parents=None,
    stream: StreamOrDevice = None,
) -> tuple[mx.array, ...]:
    """Gated delta rule over ``T`` tokens; returns ``(y, state)``, and with
    ``checkpoints`` ``(y, state, checkpoint_states)``.

    Per batch row, value head ``h`` and token ``t`` (key head ``kh``)::

        S <- exp(g[t, h]) * S
        S <- S + outer(beta[t, h] * (v[t, h] - S @ k[t, kh]), k[t, kh])
        y[t, h] = scale * (S @ q[t, kh])

    Args:
        q, k: ``[B, T, Hk, Dk]``; v: ``[B, T, Hv, Dv]`` (one dtype: float32,
            float16 or bfloat16).
        g: ``[B, T, Hv]`` log-space decay; beta: ``[B, T, Hv]``; both read in
            float32.
        state: ``[B, Hv, Dv, Dk]`` float32, or ``None`` for zeros.
        scale: readout scale, ``Dk ** -0.5`` when ``None``.
        head_mapping: ``"grouped"`` (``kh = h // (Hv // Hk)``) or
            ``"interleaved"`` (``kh = h % Hk``).
        mask: ``[B, T]`` bool; a False step leaves the state unchanged and
            outputs 0.
        normalize_qk: L2-normalise q and k per head (eps 1e-6) in float32.
        algorithm: ``"recurrent"``, ``"chunked"`` (chunks of 64, WY form) or
            ``"auto"`` (on the CPU: recurrent below 48 tokens, chunked from 48).
        checkpoints: strictly increasing token counts ``1 <= p <= T`` (a list
            of ints or a 1-D integer array with concrete values): the states
            after the first ``p`` tokens of the call, computed in the same
            pass. A masked token counts as a position.
        parents: tree verification: one index per token (a list of ints or a
            1-D integer array), ``parents[t]`` in ``[-1, t - 1]``; token t's
            step starts from token ``parents[t]``'s state (-1: ``state``), so
            each token's ``y`` is that of the sequential call along its
            root-to-token path. The returned state is the last token's; with
            ``checkpoints``, ``p`` gives token ``p - 1``'s state. Runs the
            recurrent form (``algorithm`` ``"recurrent"`` or ``"auto"``).

    Returns:
        ``y`` ``[B, T, Hv, Dv]`` in v's dtype and the new float32 state; with
        checkpoints also ``[len(checkpoints), B, Hv, Dv, Dk]`` float32. ``y``
        and the state are those of the call without checkpoints.

    Gradients: ``mx.grad`` / ``mx.vjp`` give the gradients of q, k, v, g,
    beta and state for the cotangents of both outputs, each in its input's
    dtype (accumulated in float32); masked steps get zero gradient. The
    backward recomputes the forward from one saved state per 64 tokens, so its
    memory grows with ``T / 64`` states, not ``T``. ``algorithm`` picks the
    CPU backward's form too (the chunked WY form or the recurrent one, for
    scalar and per-key gates alike). On the GPU it runs the Metal kernels
    of the recurrent form (key dims up to 256; docs/stages.md, docs/metal.md).
    """
    _check_core_arguments(q, k, v, beta, mask)
    _require_array("g", g)
    if state is not None:
        _require_array("state", state)
    for name, value in (("head_mapping", head_mapping), ("algorithm", algorithm)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return _ext.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        state,
        scale,
        head_mapping,
        mask,
        bool(normalize_qk),
        algorithm,
        stream,
        checkpoints=_checkpoints_array(checkpoints),
        parents=_index_array("parents", parents, "token indices"),
    )


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    gamma: mx.array,
    beta: mx.array,
    initial_state: mx.array | None = None,
    mask: mx.array | None = None,
    stream: StreamOrDevice = None,
) -> tuple[mx.array, mx.array]:
    """Drop-in for ``mx.fast.gated_delta_update`` (MLX 0.32): same arguments.

    ``gamma`` is the linear decay ``[B, T, Hv]``; no scale is applied and the
    head mapping is grouped. Unlike MLX's op, ``gamma`` and ``beta`` are never
    rounded to the activation dtype, and ``gamma == 0`` wipes the state exactly.

    Differentiable like ``gated_delta_rule`` (CPU only for now): ``gamma``
    receives the gradient of the linear decay itself, not one through
    ``log``, so it is finite and exact where ``gamma == 0``.
    """
    _check_core_arguments(q, k, v, beta, mask)
    _require_array("gamma", gamma)
    if initial_state is not None:
        _require_array("initial_state", initial_state)
    # log(0) = -inf is a decay of exactly 0: the kernels treat it as a wipe.
    # The gradient does not go through log (0 / 0 at a wipe): gamma is passed
    # as well and receives the gradient of the linear decay directly.
    g = mx.log(mx.stop_gradient(gamma).astype(mx.float32, stream=stream), stream=stream)
    return _ext.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        1.0,
        "grouped",
        mask,
        False,
        "auto",
        stream,
        g_name="gamma",
        state_name="initial_state",
        gamma=gamma,
    )
