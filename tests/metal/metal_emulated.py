"""The Metal backend run on the CPU: the same `.metal` kernels and dispatch
plans that macOS runs, compiled as C++ and executed by the emulator (one OS
thread per GPU thread, real barriers and SIMD collectives, Metal's limits and
sentinel guards checked). For tests; the op itself never calls this.

NumPy (or mlx) arrays in, NumPy out, with the meaning of the core op
and of the fused layer segment (docs/contract.md). bfloat16, which NumPy lacks, comes in as mlx bfloat16
arrays or as `dtype="bfloat16"` with float arrays that the wrapper rounds.

The binary is csrc/metal/emulator/module.cpp, installed on Linux as the top-level
module ``_mlx_gated_delta_metal_emulator`` (outside the package, so that a source
checkout shadowing the installed package still reaches it). It binds the params
(``CoreParams``, ``SegmentParams``) and the ``Plan`` as classes, with ``make_plan``,
``make_segment_plan``, ``make_backward_plan``, ``Plan.run`` (buffers by name) and
``run_kernel``; this module builds its calls on them. It lives beside the tests that
use it (and tools/cuda_check, which puts this folder on its path), not in the wheel.
"""

import _mlx_gated_delta_metal_emulator as _metal_emulator
import numpy as np

ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")

# A barrier that waits longer than this is reported as a deadlock.
BARRIER_TIMEOUT_MS = 60_000


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    state=None,
    *,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
    algorithm="auto",
    dtype=None,
):
    """Runs the Metal plan for one core call in the emulator.

    `dtype` is the activation dtype the kernels see ("float32", "float16",
    "bfloat16"); by default the dtype of `q`. Returns `(y, state)`: y
    `[B, T, Hv, Dv]` as float16 for float16 and as float32 otherwise (bfloat16
    values widened exactly), state `[B, Hv, Dv, Dk]` float32.
    """
    y, state, _ = run(
        q,
        k,
        v,
        g,
        beta,
        state,
        scale=scale,
        head_mapping=head_mapping,
        mask=mask,
        normalize_qk=normalize_qk,
        algorithm=algorithm,
        dtype=dtype,
    )
    return y, state


def run(
    q,
    k,
    v,
    g,
    beta,
    state=None,
    *,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
    algorithm="auto",
    dtype=None,
    through_stage=None,
    checkpoints=None,
    parents=None,
):
    """`gated_delta_rule`, plus a dict with the algorithm run, the kernels the
    plan dispatched, in order, and `buffers`: every output buffer's raw bytes
    by plan name. With `through_stage`, only the dispatches through the first
    of that stage run, and `buffers` holds the scratch too (`stage_buffers`
    reads it); y and the state are then whatever those stages left. With
    `checkpoints` (token counts, checked by the op, not here), the dict also
    holds `checkpoint_states` `[N, B, Hv, Dv, Dk]`. `parents`: tree
    verification, one parent index per token."""
    dtype = dtype or _dtype_name(q)
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be one of {ACTIVATION_DTYPES}, got {dtype!r}")
    q, k, v = (_to_float32(x) for x in (q, k, v))
    g, beta = _to_float32(g), _to_float32(beta)
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv]; got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    batch, tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    # g may be per key channel: [B, T, Hv, Dk].
    per_key_gates = g.shape == (batch, tokens, value_heads, key_dim)
    if (
        g.shape[:3] != (batch, tokens, value_heads)
        or not (per_key_gates or g.ndim == 3)
        or beta.shape != (batch, tokens, value_heads)
    ):
        raise ValueError(
            f"g must be {(batch, tokens, value_heads)} or "
            f"{(batch, tokens, value_heads, key_dim)} and beta "
            f"{(batch, tokens, value_heads)}; got {g.shape}, {beta.shape}"
        )
    state_shape = (batch, value_heads, value_dim, key_dim)
    state = np.zeros(state_shape, np.float32) if state is None else _to_float32(state)
    if state.shape != state_shape:
        raise ValueError(f"state must be {state_shape}, got {state.shape}")
    mask_bytes = None
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (batch, tokens):
            raise ValueError(f"mask must be {(batch, tokens)}, got {mask.shape}")
        mask_bytes = mask.astype(np.uint8).tobytes()
    params, inputs = _core_call(
        (q, k, v, g, beta, state),
        mask_bytes,
        dtype=dtype,
        scale=scale,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        checkpoints=checkpoints,
        parents=parents,
    )
    forward = _metal_emulator.make_plan(params, algorithm, dtype)
    buffers = _run(forward, inputs, through_stage)
    y = _activation_values(buffers["y"], dtype).reshape(batch, tokens, value_heads, value_dim)
    state_out = np.frombuffer(buffers["state_out"], np.float32).reshape(state_shape).copy()
    info = {"algorithm": forward.algorithm, "kernels": forward.kernels, "buffers": buffers}
    if checkpoints is not None:
        info["checkpoint_states"] = (
            np.frombuffer(buffers.get("checkpoint_states", b""), np.float32)
            .reshape((-1,) + state_shape)
            .copy()
        )
    return y, state_out, info


def gated_delta_rule_vjp(
    q,
    k,
    v,
    g,
    beta,
    state=None,
    *,
    y_cotangent=None,
    state_cotangent=None,
    scale=None,
    head_mapping="grouped",
    mask=None,
    normalize_qk=False,
    dtype=None,
    through_stage=None,
    algorithm="auto",
):
    """Runs the Metal backward plan of one core call in the emulator.

    The arguments are those of `reference.gated_delta_rule_reference_vjp`
    (None cotangents are zero); `dtype` is the activation dtype the kernels
    see, by default q's. Returns the dict of that function: `q`, `k` and `v`
    (float16 for float16, float32 otherwise, bfloat16 values widened exactly),
    `g`, `beta`, `state` and `decay` (the gradient of exp(g)), float32, plus
    `kernels` (the plan's, in order) and `buffers` (every returned buffer's
    raw bytes by plan name). With `through_stage`, only the dispatches through
    the first of that stage run, `buffers` holds the scratch too, and the
    gradients are left out. `algorithm` is the backward's form ("auto",
    "recurrent" or "chunked"; per-key gates always run the recurrent one).
    """
    dtype = dtype or _dtype_name(q)
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be one of {ACTIVATION_DTYPES}, got {dtype!r}")
    q, k, v = (_to_float32(x) for x in (q, k, v))
    g, beta = _to_float32(g), _to_float32(beta)
    batch, tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    state_shape = (batch, value_heads, value_dim, key_dim)
    state = np.zeros(state_shape, np.float32) if state is None else _to_float32(state)
    if y_cotangent is None:
        y_cotangent = np.zeros(v.shape, np.float32)
    if state_cotangent is None:
        state_cotangent = np.zeros(state_shape, np.float32)
    mask_bytes = None
    if mask is not None:
        mask_bytes = np.asarray(mask, dtype=bool).astype(np.uint8).tobytes()
    params, inputs = _core_call(
        (q, k, v, g, beta, state),
        mask_bytes,
        dtype=dtype,
        scale=scale,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
    )
    inputs["y_cotangent"] = _activation_bytes(_to_float32(y_cotangent), dtype)
    inputs["state_cotangent"] = _to_float32(state_cotangent).tobytes()
    backward = _metal_emulator.make_backward_plan(params, dtype, algorithm)
    buffers = _run(backward, inputs, through_stage)
    grads = {"kernels": backward.kernels, "buffers": buffers}
    if through_stage is not None:
        return grads
    for name, buffer, shape in (("q", "dq", q.shape), ("k", "dk", k.shape), ("v", "dv", v.shape)):
        grads[name] = _activation_values(buffers[buffer], dtype).reshape(shape)
    for name, buffer, shape in (
        ("g", "dg", g.shape),
        ("gamma", "dgamma", g.shape),
        ("beta", "dbeta", beta.shape),
        ("state", "dstate", state_shape),
    ):
        grads[name] = np.frombuffer(buffers[buffer], np.float32).reshape(shape).copy()
    return grads


def backward_plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    *,
    dtype="float32",
    head_mapping="grouped",
    normalize_qk=False,
    mask=False,
    per_key_gates=False,
    scale=None,
    describe=False,
    algorithm="auto",
):
    """The backward plan as a dict like `plan`'s (each dispatch also has
    `chunk`: (buffer index, chunk) for the per-chunk stages, else None), or
    with `describe=True` as a table against the assumed roofline. `algorithm`
    as `gated_delta_rule_vjp`'s."""
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale=scale,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        mask=mask,
        per_key_gates=per_key_gates,
    )
    backward = _metal_emulator.make_backward_plan(params, dtype, algorithm)
    return backward.describe() if describe else backward.as_dict()


def _core_call(
    arrays,
    mask_bytes,
    *,
    dtype,
    scale,
    head_mapping,
    normalize_qk,
    checkpoints=None,
    parents=None,
):
    """A core call's CoreParams and its input buffers by plan name (None where
    not given), from its float32 (q, k, v, g, beta, state) and options."""
    q, k, v, g, beta, state = arrays
    batch, tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    checkpoint_count = 0 if checkpoints is None else np.size(checkpoints)
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale=scale,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        mask=mask_bytes is not None,
        per_key_gates=g.ndim == 4,
        checkpoints=checkpoint_count,
        tree=parents is not None,
    )
    inputs = {
        "q": _activation_bytes(q, dtype),
        "k": _activation_bytes(k, dtype),
        "v": _activation_bytes(v, dtype),
        "g": g.tobytes(),
        "beta": beta.tobytes(),
        "state_in": state.tobytes(),
        "mask": mask_bytes,
        "checkpoints": _checkpoint_bytes(checkpoints) if checkpoint_count else None,
        "parents": _checkpoint_bytes(parents),
    }
    return params, inputs


def _core_params(
    shape,
    *,
    scale=None,
    head_mapping="grouped",
    normalize_qk=False,
    mask=False,
    per_key_gates=False,
    checkpoints=0,
    tree=False,
):
    """The CoreParams of one core call: shape (B, T, Hk, Hv, Dk, Dv), whether it
    has a mask, how many checkpoints, whether a tree; scale None is Dk**-0.5."""
    params = _metal_emulator.CoreParams(*shape)
    params.scale = shape[4] ** -0.5 if scale is None else float(scale)
    params.head_mapping = head_mapping
    params.normalize_qk = bool(normalize_qk)
    params.has_mask = bool(mask)
    params.per_key_gates = bool(per_key_gates)
    params.checkpoint_count = int(checkpoints)
    params.has_tree = bool(tree)
    return params


def _segment_params(
    shape,
    conv_kernel,
    *,
    decay_parameterization="log_rate",
    head_mapping="grouped",
    mask=False,
    norm_eps=None,
    checkpoints=0,
    per_key_gates=False,
    lower_bound=None,
    allow_neg_eigval=False,
    output_gate="silu",
):
    """The SegmentParams of one fused segment call, like `_core_params`; norm_eps
    None keeps the params' default."""
    params = _metal_emulator.SegmentParams(*shape)
    params.per_key_gates = bool(per_key_gates)
    params.lower_bound = None if lower_bound is None else float(lower_bound)
    params.allow_neg_eigval = bool(allow_neg_eigval)
    params.output_gate = output_gate
    params.conv_kernel = conv_kernel
    params.decay_parameterization = decay_parameterization
    params.head_mapping = head_mapping
    params.has_mask = bool(mask)
    if norm_eps is not None:
        params.norm_eps = float(norm_eps)
    params.checkpoint_count = int(checkpoints)
    return params


def _run(plan, inputs, through_stage):
    """Runs `plan` on the emulator over the input buffers by name that are given
    (None: no mask, checkpoints or parents); returns its buffers by name."""
    given = {name: data for name, data in inputs.items() if data is not None}
    return plan.run(given, BARRIER_TIMEOUT_MS, through_stage or "")


def _checkpoint_bytes(indices):
    """Checkpoints or parents as the int32 bytes the plan reads, or None."""
    if indices is None:
        return None
    return np.asarray(indices, dtype=np.int32).tobytes()


def gated_delta_segment(
    mixed_qkvzba,
    conv_weight,
    decay_parameter,
    dt_bias,
    norm_weight,
    conv_state=None,
    state=None,
    *,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    decay_parameterization="log_rate",
    head_mapping="grouped",
    norm_eps=1e-6,
    mask=None,
    algorithm="auto",
    dtype=None,
    lower_bound=None,
    allow_neg_eigval=False,
    output_gate="silu",
):
    """Runs the Metal plan of one fused segment call in the emulator.

    The signature of `mlx_gated_delta.gated_delta_segment`, NumPy in and out;
    `dtype` is the activation dtype the kernels see (by default the dtype of
    `mixed_qkvzba`). Returns `(out, conv_state, state)`: out `[B, T, Hv, Dv]`
    and conv_state `[B, K-1, C]` as float16 for float16 and float32 otherwise
    (bfloat16 values widened exactly), state `[B, Hv, Dv, Dk]` float32.
    """
    out, conv_state, state, _ = run_segment(
        mixed_qkvzba,
        conv_weight,
        decay_parameter,
        dt_bias,
        norm_weight,
        conv_state,
        state,
        key_heads=key_heads,
        value_heads=value_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        decay_parameterization=decay_parameterization,
        head_mapping=head_mapping,
        norm_eps=norm_eps,
        mask=mask,
        algorithm=algorithm,
        dtype=dtype,
        lower_bound=lower_bound,
        allow_neg_eigval=allow_neg_eigval,
        output_gate=output_gate,
    )
    return out, conv_state, state


def run_segment(
    mixed_qkvzba,
    conv_weight,
    decay_parameter,
    dt_bias,
    norm_weight,
    conv_state=None,
    state=None,
    *,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    decay_parameterization="log_rate",
    head_mapping="grouped",
    norm_eps=1e-6,
    mask=None,
    algorithm="auto",
    dtype=None,
    through_stage=None,
    checkpoints=None,
    lower_bound=None,
    allow_neg_eigval=False,
    output_gate="silu",
):
    """`gated_delta_segment`, plus the dict `run` returns (`through_stage`
    as there; with `checkpoints`, also `conv_checkpoint_states` and
    `checkpoint_states`). A `dt_bias` `[Hv, Dk]` makes the gates per key
    channel, as in the op."""
    dtype = dtype or _dtype_name(mixed_qkvzba)
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"dtype must be one of {ACTIVATION_DTYPES}, got {dtype!r}")
    mixed = _to_float32(mixed_qkvzba)
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    per_key_gates = _to_float32(dt_bias).ndim == 2
    gate_width = value_heads * key_dim if per_key_gates else value_heads
    width = channels + value_heads * value_dim + value_heads + gate_width
    if mixed.ndim != 3 or mixed.shape[2] != width:
        raise ValueError(f"mixed_qkvzba must be [B, T, {width}], got {mixed.shape}")
    batch, tokens = mixed.shape[:2]
    conv_weight = _to_float32(conv_weight)
    if conv_weight.ndim == 3 and conv_weight.shape[2] == 1:
        conv_weight = conv_weight[:, :, 0]
    if conv_weight.ndim != 2 or conv_weight.shape[0] != channels:
        raise ValueError(
            f"conv_weight must be [{channels}, K] or [{channels}, K, 1], got {conv_weight.shape}"
        )
    conv_kernel = conv_weight.shape[1]
    conv_state_shape = (batch, conv_kernel - 1, channels)
    conv_state = (
        np.zeros(conv_state_shape, np.float32) if conv_state is None else _to_float32(conv_state)
    )
    state_shape = (batch, value_heads, value_dim, key_dim)
    state = np.zeros(state_shape, np.float32) if state is None else _to_float32(state)
    vectors = {
        "decay_parameter": (decay_parameter, (value_heads,)),
        "dt_bias": (dt_bias, (value_heads, key_dim) if per_key_gates else (value_heads,)),
        "norm_weight": (norm_weight, (value_dim,)),
    }
    for name, (value, shape) in vectors.items():
        if _to_float32(value).shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {_to_float32(value).shape}")
    for name, value, shape in (
        ("conv_state", conv_state, conv_state_shape),
        ("state", state, state_shape),
    ):
        if value.shape != shape:
            raise ValueError(f"{name} must be {shape}, got {value.shape}")
    mask_bytes = None
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (batch, tokens):
            raise ValueError(f"mask must be {(batch, tokens)}, got {mask.shape}")
        mask_bytes = mask.astype(np.uint8).tobytes()

    checkpoint_count = 0 if checkpoints is None else np.size(checkpoints)
    params = _segment_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        conv_kernel,
        decay_parameterization=decay_parameterization,
        head_mapping=head_mapping,
        mask=mask is not None,
        norm_eps=norm_eps,
        checkpoints=checkpoint_count,
        per_key_gates=per_key_gates,
        lower_bound=lower_bound,
        allow_neg_eigval=allow_neg_eigval,
        output_gate=output_gate,
    )
    segment = _metal_emulator.make_segment_plan(params, algorithm, dtype)
    inputs = {
        "mixed": _activation_bytes(mixed, dtype),
        "conv_weight": conv_weight.tobytes(),
        "decay_parameter": _to_float32(decay_parameter).tobytes(),
        "dt_bias": _to_float32(dt_bias).tobytes(),
        "norm_weight": _to_float32(norm_weight).tobytes(),
        "conv_state_in": _activation_bytes(conv_state, dtype),
        "state_in": state.tobytes(),
        "mask": mask_bytes,
        "checkpoints": _checkpoint_bytes(checkpoints) if checkpoint_count else None,
    }
    buffers = _run(segment, inputs, through_stage)
    out = _activation_values(buffers["out"], dtype).reshape(batch, tokens, value_heads, value_dim)
    conv_state_out = _activation_values(buffers["conv_state_out"], dtype).reshape(conv_state_shape)
    state_out = np.frombuffer(buffers["state_out"], np.float32).reshape(state_shape).copy()
    info = {"algorithm": segment.algorithm, "kernels": segment.kernels, "buffers": buffers}
    if checkpoints is not None:
        info["conv_checkpoint_states"] = _activation_values(
            buffers.get("conv_checkpoint_states", b""), dtype
        ).reshape((-1,) + conv_state_shape)
        info["checkpoint_states"] = (
            np.frombuffer(buffers.get("checkpoint_states", b""), np.float32)
            .reshape((-1,) + state_shape)
            .copy()
        )
    return out, conv_state_out, state_out, info


def segment_plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    conv_kernel=4,
    *,
    dtype="float32",
    algorithm="auto",
    decay_parameterization="log_rate",
    head_mapping="grouped",
    mask=False,
    describe=False,
    checkpoints=0,
):
    """The fused segment's plan: a dict like `plan`'s, or with `describe=True`
    the table against the assumed M-series roofline; `checkpoints`: how many."""
    params = _segment_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        conv_kernel,
        decay_parameterization=decay_parameterization,
        head_mapping=head_mapping,
        mask=mask,
        checkpoints=checkpoints,
    )
    segment = _metal_emulator.make_segment_plan(params, algorithm, dtype)
    return segment.describe() if describe else segment.as_dict()


def describe_plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    *,
    dtype="float32",
    algorithm="auto",
    head_mapping="grouped",
    normalize_qk=False,
    mask=False,
    per_key_gates=False,
):
    """The plan as a table: dispatches, threadgroup memory, bytes and FLOPs
    per stage against an assumed Apple M-series roofline (stated in it).
    `per_key_gates`: g of shape [B, T, Hv, Dk]."""
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale=1.0,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        mask=mask,
        per_key_gates=per_key_gates,
    )
    return _metal_emulator.make_plan(params, algorithm, dtype).describe()


def plan(
    batch,
    tokens,
    key_heads,
    value_heads,
    key_dim,
    value_dim,
    *,
    dtype="float32",
    algorithm="auto",
    head_mapping="grouped",
    normalize_qk=False,
    mask=False,
    scale=None,
    checkpoints=0,
    tree=False,
    per_key_gates=False,
):
    """The whole plan as a dict: resolved algorithm, the kernel params as bytes,
    every buffer's size, and the dispatches; `checkpoints`: how many, `tree`:
    with parents (tree verification), `per_key_gates`: g of shape
    [B, T, Hv, Dk]."""
    params = _core_params(
        (batch, tokens, key_heads, value_heads, key_dim, value_dim),
        scale=scale,
        head_mapping=head_mapping,
        normalize_qk=normalize_qk,
        mask=mask,
        per_key_gates=per_key_gates,
        checkpoints=checkpoints,
        tree=tree,
    )
    return _metal_emulator.make_plan(params, algorithm, dtype).as_dict()


def plan_dispatches(batch, tokens, key_heads, value_heads, key_dim, value_dim, **options):
    """The plan's dispatches as dicts (stage, kernel, grid, threadgroup memory,
    bindings as (index, buffer, written), bytes and FLOPs)."""
    return plan(batch, tokens, key_heads, value_heads, key_dim, value_dim, **options)["dispatches"]


CHUNK_SIZE = 64


def stage_buffers(
    buffers, batch, tokens, key_heads, value_heads, key_dim, value_dim, per_key_gates=False
):
    """The chunked stages' scratch in the dict `run(..., through_stage=...)`
    returns, as NumPy arrays in the layouts of `reference.chunked_stages`:
    inverse norms `[B, T, Hk]`; gate_cumsum, last_wipe (int32: the last wipe
    at or before each row, or -1, decoded from the kernels' wipe masks, one
    64-bit mask per chunk) and beta_effective `[B, Hv, C, L]`; k_gram and qk
    `[B, Hk, C, L, L]`; kkt_inverse `[B, Hv, C, L, L]`; w, u and output_inter
    `[B, Hv, C, L, D]`. With `per_key_gates`, gate_cumsum and last_wipe are
    `[B, Hv, C, L, Dk]` and qk (decayed per channel) `[B, Hv, C, L, L]`.
    Buffers the plan does not have are left out."""
    chunks = -(-tokens // CHUNK_SIZE)
    tiles = (chunks, CHUNK_SIZE, CHUNK_SIZE)
    rows = (batch, value_heads, chunks, CHUNK_SIZE)
    gate_rows = rows + (key_dim,) if per_key_gates else rows
    shapes = {
        "query_inverse_norm": (batch, tokens, key_heads),
        "key_inverse_norm": (batch, tokens, key_heads),
        "gate_cumsum": gate_rows,
        "beta_effective": rows,
        "k_gram": (batch, key_heads) + tiles,
        "qk": (batch, value_heads if per_key_gates else key_heads) + tiles,
        "kkt_inverse": (batch, value_heads) + tiles,
        "w": rows + (key_dim,),
        "u": rows + (value_dim,),
        "output_inter": rows + (value_dim,),
    }
    out = {
        name: np.frombuffer(buffers[name], np.float32).reshape(shape)
        for name, shape in shapes.items()
        if name in buffers
    }
    if "wipe_mask" in buffers:
        masks = np.frombuffer(buffers["wipe_mask"], np.uint64).reshape(
            (batch, value_heads, chunks) + ((key_dim,) if per_key_gates else ())
        )
        out["last_wipe"] = last_wipe_of_masks(masks, per_key_gates)
    return out


def last_wipe_of_masks(masks, per_key_gates):
    """The last wipe at or before each row of a chunk (-1 for none), `[..., C,
    L]` (per-key: `[..., C, L, Dk]`), from the chunks' wipe masks `[..., C]`
    (`[..., C, Dk]`) whose bit i marks row i."""
    rows = np.arange(CHUNK_SIZE, dtype=np.uint64)
    if per_key_gates:
        bits = (masks[..., None, :] >> rows[:, None]) & np.uint64(1)  # [..., C, L, Dk]
        axis = -2
    else:
        bits = (masks[..., None] >> rows) & np.uint64(1)  # [..., C, L]
        axis = -1
    index = np.arange(CHUNK_SIZE).reshape((-1, 1) if per_key_gates else (-1,))
    return np.maximum.accumulate(np.where(bits == 1, index, -1), axis=axis).astype(np.int32)


def round_to_bfloat16(x):
    """float32 -> the nearest bfloat16 (ties to even), widened back to float32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def _dtype_name(x):
    name = str(x.dtype).rsplit(".", 1)[-1]
    return name if name in ACTIVATION_DTYPES else "float32"


def _to_float32(x):
    """NumPy or mlx array -> contiguous float32 NumPy (bfloat16 widened exactly)."""
    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        x = np.array(x.astype(mx.float32))
    return np.ascontiguousarray(x, dtype=np.float32)


def _activation_bytes(x, dtype):
    if dtype == "float32":
        return x.tobytes()
    if dtype == "float16":
        return x.astype(np.float16).tobytes()
    return (round_to_bfloat16(x).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _activation_values(data, dtype):
    if dtype == "float32":
        return np.frombuffer(data, np.float32).copy()
    if dtype == "float16":
        return np.frombuffer(data, np.float16).copy()
    bits = np.frombuffer(data, np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def main(argv=None):
    """`python tests/metal/metal_emulated.py [B T Hk Hv Dk Dv] [--dtype D]
    [--algorithm A] [--normalize-qk] [--segment K] [--backward]`: prints a plan
    (default: the Qwen3-Next prefill, B=1 T=8192 Hk=16 Hv=32 D=128, bfloat16);
    with `--segment K` the fused segment's plan with a K-tap conv, with
    `--backward` the backward's plan."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("shape", nargs="*", type=int, default=[1, 8192, 16, 32, 128, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=ACTIVATION_DTYPES)
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--normalize-qk", action="store_true")
    parser.add_argument(
        "--segment", type=int, metavar="K", help="the fused segment's plan with a conv of K taps"
    )
    parser.add_argument(
        "--backward", action="store_true", help="the backward's plan (the vjp of the core op)"
    )
    options = parser.parse_args(argv)
    if len(options.shape) != 6:
        parser.error("the shape is six integers: B T Hk Hv Dk Dv")
    if options.backward:
        print(
            backward_plan(
                *options.shape,
                dtype=options.dtype,
                normalize_qk=options.normalize_qk,
                describe=True,
                algorithm=options.algorithm,
            ),
            end="",
        )
        return
    if options.segment is not None:
        print(
            segment_plan(
                *options.shape,
                options.segment,
                dtype=options.dtype,
                algorithm=options.algorithm,
                describe=True,
            ),
            end="",
        )
        return
    print(
        describe_plan(
            *options.shape,
            dtype=options.dtype,
            algorithm=options.algorithm,
            normalize_qk=options.normalize_qk,
        ),
        end="",
    )


if __name__ == "__main__":
    main()
