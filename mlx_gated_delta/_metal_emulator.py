"""The Metal emulator (csrc/metal/emulator/module.cpp), for tests only.

Installed as the top-level module ``_mlx_gated_delta_metal_emulator`` for the
same reason as ``_ext``: a source checkout that shadows the installed package
still reaches the installed binary.

The binary binds the params (``CoreParams``, ``SegmentParams``) and the
``Plan`` as classes, with ``make_plan``, ``make_segment_plan``,
``make_backward_plan``, ``Plan.run`` and ``run_kernel``. The functions below
compose them into the calls ``testing/metal_emulated.py`` makes: one call's
bytes in, its outputs' bytes (and the plan's facts) out.
"""

from _mlx_gated_delta_metal_emulator import (  # noqa: F401
    CoreParams,
    Plan,
    SegmentParams,
    make_backward_plan,
    make_plan,
    make_segment_plan,
    run_kernel,
)


def _core_params(
    shape,
    scale=1.0,
    head_mapping="grouped",
    normalize_qk=False,
    has_mask=False,
    per_key_gates=False,
):
    params = CoreParams(*shape)
    params.scale = scale
    params.head_mapping = head_mapping
    params.normalize_qk = normalize_qk
    params.has_mask = has_mask
    params.per_key_gates = per_key_gates
    return params


def _segment_params(
    shape, conv_kernel, decay_parameterization, head_mapping, has_mask, norm_eps=None
):
    params = SegmentParams(*shape)
    params.conv_kernel = conv_kernel
    params.decay_parameterization = decay_parameterization
    params.head_mapping = head_mapping
    params.has_mask = has_mask
    if norm_eps is not None:
        params.norm_eps = norm_eps
    return params


def _present(**buffers):
    """The named buffers that were given (a mask, checkpoints or parents may not be)."""
    return {name: data for name, data in buffers.items() if data is not None}


def run_core(
    q,
    k,
    v,
    g,
    beta,
    state,
    mask,
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    scale,
    head_mapping,
    normalize_qk,
    algorithm,
    dtype,
    barrier_timeout_ms,
    through_stage="",
    checkpoints=None,
    parents=None,
    per_key_gates=False,
):
    """Runs the plan of one core call (g [B, T, Hv, Dk] with per_key_gates).

    Returns (y bytes, state bytes, algorithm, kernels, {buffer name: bytes});
    with through_stage only the dispatches through that stage run and the
    dict holds the scratch buffers too. checkpoints: int32 bytes (the dict
    then holds checkpoint_states); parents: int32 bytes (tree verification).
    """
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale,
        head_mapping,
        normalize_qk,
        mask is not None,
        per_key_gates,
    )
    params.checkpoint_count = len(checkpoints) // 4 if checkpoints is not None else 0
    params.has_tree = parents is not None
    plan = make_plan(params, algorithm, dtype)
    inputs = _present(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        state_in=state,
        mask=mask,
        checkpoints=checkpoints if params.checkpoint_count > 0 else None,
        parents=parents,
    )
    buffers = plan.run(inputs, barrier_timeout_ms, through_stage)
    return buffers["y"], buffers["state_out"], plan.algorithm, plan.kernels, buffers


def run_backward(
    q,
    k,
    v,
    g,
    beta,
    state,
    mask,
    y_cotangent,
    state_cotangent,
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    scale,
    head_mapping,
    normalize_qk,
    per_key_gates,
    dtype,
    barrier_timeout_ms,
    through_stage="",
    algorithm="auto",
):
    """Runs the backward plan of one core call; returns (kernels, {buffer name: bytes}).

    The dict holds every gradient (dq, dk, dv, dg, d_decay, dbeta, dstate);
    with through_stage only the dispatches through the first of that stage
    run and it holds the scratch too. algorithm: the backward's form.
    """
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale,
        head_mapping,
        normalize_qk,
        mask is not None,
        per_key_gates,
    )
    plan = make_backward_plan(params, dtype, algorithm)
    inputs = _present(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        state_in=state,
        mask=mask,
        y_cotangent=y_cotangent,
        state_cotangent=state_cotangent,
    )
    return plan.kernels, plan.run(inputs, barrier_timeout_ms, through_stage)


def plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    dtype="float32",
    algorithm="auto",
    head_mapping="grouped",
    normalize_qk=False,
    has_mask=False,
    scale=1.0,
    checkpoints=0,
    tree=False,
    per_key_gates=False,
):
    """The plan as a dict (Plan.as_dict), with `checkpoints` positions and parents for `tree`."""
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale,
        head_mapping,
        normalize_qk,
        has_mask,
        per_key_gates,
    )
    params.checkpoint_count = checkpoints
    params.has_tree = tree
    return make_plan(params, algorithm, dtype).as_dict()


def describe_plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    dtype="float32",
    algorithm="auto",
    head_mapping="grouped",
    normalize_qk=False,
    has_mask=False,
    per_key_gates=False,
):
    """A readable table of the plan against an assumed M-series roofline."""
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        1.0,
        head_mapping,
        normalize_qk,
        has_mask,
        per_key_gates,
    )
    return make_plan(params, algorithm, dtype).describe()


def backward_plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    dtype="float32",
    head_mapping="grouped",
    normalize_qk=False,
    has_mask=False,
    per_key_gates=False,
    scale=1.0,
    describe=False,
    algorithm="auto",
):
    """The backward plan as a dict like plan()'s, or with describe=True as a table."""
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale,
        head_mapping,
        normalize_qk,
        has_mask,
        per_key_gates,
    )
    backward = make_backward_plan(params, dtype, algorithm)
    return backward.describe() if describe else backward.as_dict()


def run_segment(
    mixed,
    conv_weight,
    decay_parameter,
    dt_bias,
    norm_weight,
    conv_state,
    state,
    mask,
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    conv_kernel,
    decay_parameterization,
    head_mapping,
    norm_eps,
    algorithm,
    dtype,
    barrier_timeout_ms,
    through_stage="",
    checkpoints=None,
):
    """Runs the plan of one fused segment call.

    Returns (out bytes, conv_state bytes, state bytes, algorithm, kernels,
    {buffer name: bytes}); with through_stage only the dispatches through
    that stage run and the dict holds the scratch buffers too.
    """
    params = _segment_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        conv_kernel,
        decay_parameterization,
        head_mapping,
        mask is not None,
        norm_eps,
    )
    params.checkpoint_count = len(checkpoints) // 4 if checkpoints is not None else 0
    segment = make_segment_plan(params, algorithm, dtype)
    inputs = _present(
        mixed=mixed,
        conv_weight=conv_weight,
        decay_parameter=decay_parameter,
        dt_bias=dt_bias,
        norm_weight=norm_weight,
        conv_state_in=conv_state,
        state_in=state,
        mask=mask,
        checkpoints=checkpoints if params.checkpoint_count > 0 else None,
    )
    buffers = segment.run(inputs, barrier_timeout_ms, through_stage)
    return (
        buffers["out"],
        buffers["conv_state_out"],
        buffers["state_out"],
        segment.algorithm,
        segment.kernels,
        buffers,
    )


def segment_plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    conv_kernel,
    dtype="float32",
    algorithm="auto",
    decay_parameterization="log_rate",
    head_mapping="grouped",
    has_mask=False,
    describe=False,
    checkpoints=0,
):
    """The fused segment's plan as a dict like plan()'s, or with describe=True as a table."""
    params = _segment_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        conv_kernel,
        decay_parameterization,
        head_mapping,
        has_mask,
    )
    params.checkpoint_count = checkpoints
    segment = make_segment_plan(params, algorithm, dtype)
    return segment.describe() if describe else segment.as_dict()
