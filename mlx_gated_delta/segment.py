"""The fused layer segment (docs/contract.md)."""

from __future__ import annotations

import mlx.core as mx

from . import _ext
from .ops import StreamOrDevice, _checkpoints_array, _require_array


def gated_delta_segment(
    mixed_qkvzba: mx.array,
    conv_weight: mx.array,
    decay_parameter: mx.array,
    dt_bias: mx.array,
    norm_weight: mx.array,
    conv_state: mx.array | None = None,
    state: mx.array | None = None,
    *,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    decay_parameterization: str = "log_rate",
    head_mapping: str = "grouped",
    norm_eps: float = 1e-6,
    mask: mx.array | None = None,
    algorithm: str = "auto",
    checkpoints=None,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
    output_gate: str = "silu",
    stream: StreamOrDevice = None,
) -> tuple[mx.array, ...]:
    """A Gated DeltaNet token mixer from its packed input projection to the
    gated norm, in one op; returns ``(out, conv_state, state)``, and with
    ``checkpoints`` also ``(conv_checkpoint_states, checkpoint_states)``.

    Per token: ``q|k|v = silu(causal_conv(q|k|v))`` with the carried conv
    state; ``g = rate * softplus(a + dt_bias)``; ``beta = sigmoid(b)``; q and k
    L2-normalized per head (eps 1e-6); the delta-rule recurrence with scale
    ``Dk ** -0.5``; ``out = rms_norm(y, norm_eps) * norm_weight * silu(z)``.
    All intermediate math is float32; the recurrent state is float32.

    Args:
        mixed_qkvzba: ``[B, T, F]`` packed per token as ``[q | k | v | z | b | a]``
            (``F = 2*Hk*Dk + 2*Hv*Dv + 2*Hv``), float32, float16 or bfloat16.
        conv_weight: ``[C, K]`` or mlx's Conv1d layout ``[C, K, 1]`` over the
            ``C = 2*Hk*Dk + Hv*Dv`` channels q|k|v.
        decay_parameter: ``[Hv]``: ``A_log`` for ``"log_rate"`` (rate =
            ``-exp(A_log)``) or the negative rate for ``"negative_rate"``.
        dt_bias: ``[Hv]``, or ``[Hv, Dk]`` for gates per key channel (Kimi
            Delta Attention): then ``a`` is ``Hv*Dk`` wide (``F = 2*Hk*Dk +
            2*Hv*Dv + Hv + Hv*Dk``) and ``g`` is ``[B, T, Hv, Dk]``, with
            ``a``, ``dt_bias`` and ``g`` read per head and key channel.
        norm_weight: ``[Dv]``.
        conv_state: ``[B, K-1, C]`` in the activation dtype (mlx-lm's cache
            layout: the last K-1 pre-conv inputs), or ``None`` for zeros.
        state: ``[B, Hv, Dv, Dk]`` float32, or ``None`` for zeros.
        head_mapping: ``"grouped"`` or ``"interleaved"``.
        mask: ``[B, T]`` bool. A False token is skipped as if it were not in
            the sequence: it enters neither the conv window nor the state,
            and its ``out`` row is 0.
        algorithm: the core's ``"recurrent"``, ``"chunked"`` or ``"auto"``.
        checkpoints: strictly increasing token counts ``1 <= p <= T``, as for
            ``gated_delta_rule``: the conv state and the state after the
            first ``p`` tokens of the call.
        lower_bound: ``None``, or a float ``<= 0``: then ``g = lower_bound *
            sigmoid(-rate * (a + dt_bias))`` (in ``[lower_bound, 0]``; with
            ``"log_rate"``, ``-rate = exp(A_log)``), the lower-bounded decay
            of Kimi-K3 and Bailing-MoE-V3.
        allow_neg_eigval: ``beta = 2 sigmoid(b)``, in ``[0, 2]`` (OLMo-Hybrid).
        output_gate: ``"silu"`` (``out = rms_norm(y) * norm_weight *
            silu(z)``) or ``"sigmoid"`` (``... * sigmoid(z)``, Kimi Delta
            Attention's ``o_norm(y) * sigmoid(gate)``).

    Returns:
        ``out`` ``[B, T, Hv, Dv]`` in the activation dtype, the new
        ``conv_state`` and the new float32 ``state``; with checkpoints also
        ``[N, B, K-1, C]`` conv states (activation dtype) and
        ``[N, B, Hv, Dv, Dk]`` float32 states.

    Gradients: ``mx.grad`` / ``mx.vjp`` give the gradient of every array
    input (the packed input, the conv weight, the decay parameter, dt_bias,
    the norm weight, the conv state and the state) for the cotangents of all
    three outputs, each in its input's dtype; skipped (masked) tokens get
    zero gradient. The recurrence is differentiated through the core op's
    backward; the conv, gates and norm in float32, by kernels on the CPU and
    by MLX ops on the GPU (Metal kernels for the core, key dims up to 256).
    ``mx.vmap`` maps over the packed input, the states and the mask (not
    over the parameters).
    """
    for name, value in (
        ("mixed_qkvzba", mixed_qkvzba),
        ("conv_weight", conv_weight),
        ("decay_parameter", decay_parameter),
        ("dt_bias", dt_bias),
        ("norm_weight", norm_weight),
    ):
        _require_array(name, value)
    for name, value in (("conv_state", conv_state), ("state", state), ("mask", mask)):
        if value is not None:
            _require_array(name, value)
    for name, value in (
        ("decay_parameterization", decay_parameterization),
        ("head_mapping", head_mapping),
        ("algorithm", algorithm),
        ("output_gate", output_gate),
    ):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return _ext.gated_delta_segment(
        mixed_qkvzba,
        conv_weight,
        decay_parameter,
        dt_bias,
        norm_weight,
        conv_state,
        state,
        int(key_heads),
        int(value_heads),
        int(key_dim),
        int(value_dim),
        decay_parameterization,
        head_mapping,
        float(norm_eps),
        mask,
        algorithm,
        stream,
        checkpoints=_checkpoints_array(checkpoints),
        lower_bound=None if lower_bound is None else float(lower_bound),
        allow_neg_eigval=bool(allow_neg_eigval),
        output_gate=output_gate,
    )
