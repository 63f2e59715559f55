"""Runs the Metal plans of the exported cases on an NVIDIA GPU: the .metal
kernels compiled as CUDA by NVRTC (CuPy RawModule), dispatched in the plan's
order with the plan's grids and bindings. Every buffer carries sentinel guard
bytes, checked after each dispatch; CuPy's memory pool is off so that
compute-sanitizer's memcheck sees each buffer's true bounds.

Usage: run_cuda.py DIR [--source kernels|kernels_broken] [--cases a,b] [--out results.npz]
"""

import argparse
import json
import os

import cupy as cp
import numpy as np

GUARD = 64
SENTINEL = 0xA5
UNWRITTEN = 0xFF  # NaN in every float format


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--source", default="kernels")
    parser.add_argument("--cases", default="")
    parser.add_argument("--out", default="")
    options = parser.parse_args()
    cp.cuda.set_allocator(None)

    with open(os.path.join(options.dir, f"{options.source}.cu")) as handle:
        source = handle.read()
    with open(os.path.join(options.dir, f"{options.source}.json")) as handle:
        argument_order = json.load(handle)
    with open(os.path.join(options.dir, "cases.json")) as handle:
        plans = json.load(handle)
    arrays = np.load(os.path.join(options.dir, "cases.npz"))
    include = ["-I" + os.path.abspath(options.dir)]
    if os.path.isdir("/usr/local/cuda/include"):
        include.append("-I/usr/local/cuda/include")
    module = cp.RawModule(code=source, options=("-default-device", "-std=c++17", *include))

    names = options.cases.split(",") if options.cases else list(plans)
    results = {}
    for name in names:
        plan = plans[name]
        buffers = {}
        for buffer, size in plan["buffer_bytes"].items():
            storage = cp.full(size + 2 * GUARD, UNWRITTEN, dtype=cp.uint8)
            storage[:GUARD] = SENTINEL
            storage[GUARD + size :] = SENTINEL
            key = f"{name}/{buffer}"
            if key in arrays.files:
                assert arrays[key].size == size, (key, arrays[key].size, size)
                storage[GUARD : GUARD + size] = cp.asarray(arrays[key])
            buffers[buffer] = storage
        for dispatch in plan["dispatches"]:
            bound = {index: buffers[buffer][GUARD:] for index, buffer, _ in dispatch["buffers"]}
            # The dispatch's scalar block (the core's or the segment's).
            bound[dispatch["params_index"]] = cp.asarray(
                np.frombuffer(bytes.fromhex(dispatch["params"]), np.uint8)
            )
            # A per-chunk stage's chunk, a scalar of its own (Metal's setBytes).
            if dispatch.get("chunk") is not None:
                index, chunk = dispatch["chunk"]
                bound[index] = cp.asarray(np.array([chunk], np.uint32).view(np.uint8))
            arguments = tuple(
                bound.get(index, np.uint64(0)) for index in argument_order[dispatch["kernel"]]
            )
            kernel = module.get_function(dispatch["kernel"])
            kernel(
                tuple(dispatch["threadgroups"]),
                (dispatch["threads_per_threadgroup"], 1, 1),
                arguments,
            )
            cp.cuda.runtime.deviceSynchronize()
            for buffer, storage in buffers.items():
                guards = cp.concatenate([storage[:GUARD], storage[-GUARD:]])
                if not bool((guards == SENTINEL).all()):
                    raise SystemExit(
                        f"{name}: {dispatch['stage']} ({dispatch['kernel']}) wrote "
                        f"outside buffer {buffer}"
                    )
        outputs = [buffer for buffer, role in plan["buffer_roles"].items() if role == "output"]
        for buffer in outputs:
            size = plan["buffer_bytes"][buffer]
            results[f"{name}/{buffer}"] = cp.asnumpy(buffers[buffer][GUARD : GUARD + size])
        kernels = sorted({d["kernel"] for d in plan["dispatches"]})
        print(
            f"ran {name}: {len(plan['dispatches'])} dispatches, kernels {', '.join(kernels)}",
            flush=True,
        )
    if options.out:
        np.savez(options.out, **results)


if __name__ == "__main__":
    main()
