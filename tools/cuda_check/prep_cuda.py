"""Turns the .metal kernels into one CUDA source for NVRTC (tools/cuda_check).

The same parsing as the emulator's rewrite (csrc/metal/emulator/prep_metal.py):
local headers are inlined once, `threadgroup` arrays become `__shared__`,
attributes go, the instantiation lines are checked and their host names read
off the C preprocessor's expansion of the kernels' own macro, and every
host-named kernel gets an `extern "C" __global__` wrapper that passes its
buffers and built-in positions. Also writes a JSON map host name -> buffer indices in the wrapper's
argument order.

Usage: prep_cuda.py OUT.cu OUT.json KERNEL.metal...
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "metal", "emulator"))
import prep_metal  # noqa: E402

LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"(?P<path>[^"]+)"\s*$')
SYSTEM_INCLUDE = re.compile(r"^\s*#\s*include\s+<metal_stdlib>\s*$")
ANY_ATTRIBUTE = re.compile(r"\[\[[^\]]*\]\]")

BUILTINS = {
    "threadgroup_position_in_grid": "make_uint3(blockIdx.x, blockIdx.y, blockIdx.z)",
    "thread_position_in_grid": "make_uint3(blockIdx.x * blockDim.x + threadIdx.x, "
    "blockIdx.y * blockDim.y + threadIdx.y, "
    "blockIdx.z * blockDim.z + threadIdx.z)",
    "thread_position_in_threadgroup": "make_uint3(threadIdx.x, threadIdx.y, threadIdx.z)",
    "threads_per_threadgroup": "make_uint3(blockDim.x, blockDim.y, blockDim.z)",
    "threadgroups_per_grid": "make_uint3(gridDim.x, gridDim.y, gridDim.z)",
    "thread_index_in_threadgroup": "linear",
    "thread_index_in_simdgroup": "linear % 32u",
    "simdgroup_index_in_threadgroup": "linear / 32u",
    "threads_per_simdgroup": "32u",
}


def inline(path, seen, out):
    path = os.path.normpath(path)
    if path in seen:
        return
    seen.add(path)
    with open(path) as handle:
        for line in handle.read().split("\n"):
            include = LOCAL_INCLUDE.match(line)
            if include:
                inline(os.path.join(os.path.dirname(path), include["path"]), seen, out)
            elif SYSTEM_INCLUDE.match(line) or line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)


def cuda_argument(parameter):
    found = prep_metal.ATTRIBUTE.search(parameter)
    attribute, argument = found["attr"], found["arg"]
    declared_type = parameter[: found.start()].rsplit(None, 1)[0]
    if attribute == "buffer":
        holder = "BufferReference" if "&" in declared_type else "BufferPointer"
        return int(argument), f"{holder}{{buffer_{argument}}}"
    value = BUILTINS[attribute]
    if not declared_type.replace("const", "").split()[-1].endswith("3"):
        value = f"({value}).x" if value.startswith("make_uint3") else value
    return None, value


def main(out_source, out_map, kernel_paths):
    seen, lines = set(), []
    for path in kernel_paths:
        inline(path, seen, lines)
    body, calls = [], []
    in_macro = False
    for line in lines:
        # The instantiations are checked through what the kernels' own macro
        # expands to (prep_metal.expand_instantiations), which also gives the
        # host names. NVRTC, like upstream clang, refuses attributes on an
        # explicit instantiation, so the macro and its uses stay out of the
        # CUDA source: each wrapper below instantiates its kernel.
        if prep_metal.MACRO_DEFINITION.match(line) or in_macro:
            in_macro = line.rstrip().endswith("\\")
            body.append("")
            continue
        if prep_metal.INSTANTIATION.match(line):
            calls.append(line)
            body.append("")
            continue
        array = prep_metal.THREADGROUP_ARRAY.match(line)
        if array:
            line = f"{array['indent']}__shared__ {array['decl']};{array['rest']}"
        body.append(ANY_ATTRIBUTE.sub("", line))
    source = "\n".join(lines)
    kernels = prep_metal.find_kernels(source)
    entries = [
        (name, name, params) for name, (params, is_template) in kernels.items() if not is_template
    ]
    instantiations = prep_metal.expand_instantiations("the CUDA source", calls, [source])
    entries += [
        (host, f"{function}<{args}>", kernels[function][0])
        for host, function, args in instantiations
    ]

    wrappers, argument_map = [], {}
    for host, callee, parameters in entries:
        converted = [cuda_argument(p) for p in parameters]
        indices = [index for index, _ in converted if index is not None]
        signature = ", ".join(f"void* buffer_{index}" for index in indices)
        arguments = ",\n      ".join(value for _, value in converted)
        wrappers.append(
            f'extern "C" __global__ void {host}({signature}) {{\n'
            "  [[maybe_unused]] const uint linear =\n"
            "      threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);\n"
            f"  {callee}(\n      {arguments});\n}}\n"
        )
        argument_map[host] = indices
    with open(out_source, "w") as handle:
        handle.write('#include "metal_cuda.h"\n')
        handle.write("\n".join(body))
        handle.write("\n\n" + "\n".join(wrappers))
    with open(out_map, "w") as handle:
        json.dump(argument_map, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
