"""Prepares a CUDA check of the Metal kernels (run here, where the package is
built): the kernels as one CUDA source, a deliberately broken copy (a barrier
deleted), and each case's inputs and Metal plan.

Usage: python tools/cuda_check/export.py OUT_DIR
Then on the GPU machine: bash OUT_DIR/run.sh, and here:
python tools/cuda_check/compare.py RESULTS.npz
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
# metal_emulated.py lives beside the emulator's tests, outside the package.
sys.path.insert(0, os.path.join(ROOT, "tests", "metal"))
from cases import (  # noqa: E402
    BACKWARD_CASES,
    CASES,
    CHECKPOINT_CASES,
    SEGMENT_CASES,
    backward_cotangents,
    make_case,
)

KERNELS = [
    "recurrent",
    "qk_norm",
    "gate_cumsum",
    "k_gram",
    "kkt_inverse",
    "recompute_w_u",
    "chunk_qk",
    "chunk_carry",
    "chunk_output",
    "prepare_conv",
    "prepare_gates",
    "collect_conv_state",
    "gated_norm",
    "boundary_states",
    "chunk_states",
    "recurrent_chunk_backward",
    "qk_grad_reduce",
    "chunk_output_backward",
    "chunk_carry_backward",
    "recompute_w_u_backward",
    "kkt_inverse_backward",
    "gate_cumsum_backward",
    "channel_pairs_backward",
]
BROKEN_BARRIER = (
    "staged before any output reads it.\n  threadgroup_barrier(mem_flags::mem_threadgroup);"
)
# recurrent_chunk_backward's first barrier, deleted in the same broken copy (the
# backward cases reach recurrent_chunk_backward and not chunk_output).
BROKEN_BACKWARD_BARRIER = (
    "previous token's partial sums.\n    threadgroup_barrier(mem_flags::mem_threadgroup);"
)


def prep(kernel_dir, out_dir, stem):
    paths = [os.path.join(kernel_dir, f"{name}.metal") for name in KERNELS]
    subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "prep_cuda.py"),
            os.path.join(out_dir, f"{stem}.cu"),
            os.path.join(out_dir, f"{stem}.json"),
            *paths,
        ],
        check=True,
    )


def json_ready(plan, dtype):
    """The plan with its scalar blocks as hex strings, and the dtype."""
    plan["kernel_params"] = plan["kernel_params"].hex()
    for dispatch in plan["dispatches"]:
        dispatch["params"] = dispatch["params"].hex()
    plan["dtype"] = dtype
    return plan


def export_segment_case(name, algorithm, case, arrays, checkpoints=None):
    import metal_emulated

    recipe = case.recipe
    dtype = recipe["dtype"]
    mask = case.options["mask"]
    plan = metal_emulated.segment_plan(
        recipe["batch"],
        recipe["tokens"],
        recipe["key_heads"],
        recipe["value_heads"],
        recipe["key_dim"],
        recipe["value_dim"],
        recipe["conv_kernel"],
        dtype=dtype,
        algorithm=algorithm,
        decay_parameterization=recipe["decay_parameterization"],
        head_mapping=recipe["head_mapping"],
        mask=mask is not None,
        checkpoints=len(checkpoints or ()),
    )
    f32 = metal_emulated._to_float32
    channels = (
        2 * recipe["key_heads"] * recipe["key_dim"] + recipe["value_heads"] * recipe["value_dim"]
    )
    conv_state = (
        np.zeros((recipe["batch"], recipe["conv_kernel"] - 1, channels), np.float32)
        if case.conv_state is None
        else f32(case.conv_state)
    )
    state = (
        np.zeros(
            (recipe["batch"], recipe["value_heads"], recipe["value_dim"], recipe["key_dim"]),
            np.float32,
        )
        if case.state is None
        else f32(case.state)
    )
    raw = {
        "mixed": metal_emulated._activation_bytes(f32(case.mixed), dtype),
        "conv_weight": f32(case.conv_weight).reshape(channels, -1).tobytes(),
        "decay_parameter": f32(case.decay_parameter).tobytes(),
        "dt_bias": f32(case.dt_bias).tobytes(),
        "norm_weight": f32(case.norm_weight).tobytes(),
        "conv_state_in": metal_emulated._activation_bytes(conv_state, dtype),
        "state_in": state.tobytes(),
    }
    if mask is not None:
        raw["mask"] = np.array(mask).astype(np.uint8).tobytes()
    if checkpoints:
        raw["checkpoints"] = np.array(checkpoints, np.int32).tobytes()
    for buffer, data in raw.items():
        arrays[f"{name}/{buffer}"] = np.frombuffer(data, np.uint8)
    return json_ready(plan, dtype)


def export_core_case(name, algorithm, case, arrays, checkpoints=None, parents=None):
    import metal_emulated

    recipe = case.recipe
    dtype = recipe["dtype"]
    q, k, v, g, beta, state = case.args()
    mask = case.options["mask"]
    plan = metal_emulated.plan(
        recipe["batch"],
        recipe["tokens"],
        recipe["key_heads"],
        recipe["value_heads"],
        recipe["key_dim"],
        recipe["value_dim"],
        dtype=dtype,
        algorithm=algorithm,
        head_mapping=recipe["head_mapping"],
        normalize_qk=recipe["normalize_qk"],
        mask=mask is not None,
        scale=case.options["scale"],
        checkpoints=len(checkpoints or ()),
        tree=parents is not None,
        per_key_gates=recipe["per_key_gates"],
    )
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_in": state}
    for buffer, value in inputs.items():
        value = (
            metal_emulated._to_float32(value)
            if value is not None
            else np.zeros(
                (recipe["batch"], recipe["value_heads"], recipe["value_dim"], recipe["key_dim"]),
                np.float32,
            )
        )
        raw = (
            metal_emulated._activation_bytes(value, dtype)
            if buffer in ("q", "k", "v")
            else value.tobytes()
        )
        arrays[f"{name}/{buffer}"] = np.frombuffer(raw, np.uint8)
    if mask is not None:
        arrays[f"{name}/mask"] = np.array(mask).astype(np.uint8).reshape(-1)
    for buffer, indices in (("checkpoints", checkpoints), ("parents", parents)):
        if indices:
            arrays[f"{name}/{buffer}"] = np.frombuffer(
                np.array(indices, np.int32).tobytes(), np.uint8
            )
    return json_ready(plan, dtype)


def export_backward_case(name, algorithm, case, arrays):
    import metal_emulated

    recipe = case.recipe
    dtype = recipe["dtype"]
    q, k, v, g, beta, state = case.args()
    mask = case.options["mask"]
    plan = metal_emulated.backward_plan(
        recipe["batch"],
        recipe["tokens"],
        recipe["key_heads"],
        recipe["value_heads"],
        recipe["key_dim"],
        recipe["value_dim"],
        dtype=dtype,
        head_mapping=recipe["head_mapping"],
        normalize_qk=recipe["normalize_qk"],
        mask=mask is not None,
        per_key_gates=recipe["per_key_gates"],
        scale=case.options["scale"],
        algorithm=algorithm,
    )
    y_cotangent, state_cotangent = backward_cotangents(case)
    f32 = metal_emulated._to_float32
    raw = {
        "q": metal_emulated._activation_bytes(f32(q), dtype),
        "k": metal_emulated._activation_bytes(f32(k), dtype),
        "v": metal_emulated._activation_bytes(f32(v), dtype),
        "g": f32(g).tobytes(),
        "beta": f32(beta).tobytes(),
        "state_in": (np.zeros_like(state_cotangent) if state is None else f32(state)).tobytes(),
        "y_cotangent": metal_emulated._activation_bytes(y_cotangent, dtype),
        "state_cotangent": state_cotangent.tobytes(),
    }
    if mask is not None:
        raw["mask"] = np.array(mask).astype(np.uint8).tobytes()
    for buffer, data in raw.items():
        arrays[f"{name}/{buffer}"] = np.frombuffer(data, np.uint8)
    return json_ready(plan, dtype)


def main(out_dir):

    os.makedirs(out_dir, exist_ok=True)
    kernel_dir = os.path.join(ROOT, "csrc", "metal", "kernels")
    prep(kernel_dir, out_dir, "kernels")
    broken_dir = os.path.join(out_dir, "broken_kernels")
    shutil.copytree(kernel_dir, broken_dir, dirs_exist_ok=True)
    for file, barrier in (
        ("chunk_output.metal", BROKEN_BARRIER),
        ("recurrent_chunk_backward.metal", BROKEN_BACKWARD_BARRIER),
    ):
        path = os.path.join(broken_dir, file)
        text = open(path).read()
        assert text.count(barrier) == 1
        open(path, "w").write(text.replace(barrier, barrier.split("\n")[0]))
    prep(broken_dir, out_dir, "kernels_broken")
    shutil.rmtree(broken_dir)
    for name in ("metal_cuda.h", "run_cuda.py", "run.sh"):
        shutil.copy(os.path.join(HERE, name), out_dir)

    arrays, plans = {}, {}
    for name in SEGMENT_CASES:
        algorithm, case = make_case(name)
        plans[name] = export_segment_case(name, algorithm, case, arrays)
    for name in CASES:
        plans[name] = export_core_case(name, *make_case(name), arrays)
    for name, (source, checkpoints, parents) in CHECKPOINT_CASES.items():
        algorithm, case = make_case(name)
        if source in SEGMENT_CASES:
            plans[name] = export_segment_case(name, algorithm, case, arrays, checkpoints)
        else:
            plans[name] = export_core_case(name, algorithm, case, arrays, checkpoints, parents)
    for name in BACKWARD_CASES:
        plans[name] = export_backward_case(name, *make_case(name), arrays)
    np.savez(os.path.join(out_dir, "cases.npz"), **arrays)
    with open(os.path.join(out_dir, "cases.json"), "w") as handle:
        json.dump(plans, handle, indent=1)
    print(f"exported {len(plans)} cases to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
