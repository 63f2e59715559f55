"""Turns a .metal file into C++ the emulator compiles (run by CMake at build time).

Two rewrites, each keeping the line count so that `#line` maps every compiler,
sanitizer and divergence report back to the .metal line:

* `threadgroup` on a block-scope array declaration becomes `static` (the
  emulator runs threadgroups one at a time, so one copy is right), and the array
  registers itself for the emulator's threadgroup-memory accounting; every other
  `threadgroup` (an address-space qualifier on a pointer) is dropped. Headers
  the kernel includes are compiled as they are (the shim defines `threadgroup`
  away), so they must declare no threadgroup arrays: that is checked here.
* `instantiate_kernel("host_name", function, types)` lines stay as they are:
  the C++ compiler expands the kernels' own macro and must parse what it
  expands to, attributes included, as Metal's compiler does (a malformed
  instantiation macro fails the emulator build). Each instantiation, and each
  non-template kernel, also gets a generated entry point that passes the bound
  buffers and the built-in positions as ordinary arguments, registered under
  its host name.

Usage: prep_metal.py INPUT.metal OUTPUT.cpp
"""

import os
import re
import sys

THREADGROUP_ARRAY = re.compile(
    r"^(?P<indent>\s*)threadgroup\s+(?P<decl>[^;]*?\b(?P<name>\w+)\s*\[[^;]*\])\s*;(?P<rest>.*)$")
THREADGROUP_WORD = re.compile(r"\bthreadgroup\b(?!_)\s*")
INSTANTIATION = re.compile(
    r'^\s*instantiate_kernel\(\s*"(?P<host>\w+)"\s*,\s*(?P<function>\w+)\s*,(?P<args>[^)]*)\)\s*$')
KERNEL_HEAD = re.compile(r"(?:\[\[kernel\]\]|\bkernel)\s+void\s+(?P<name>\w+)\s*\(")
ATTRIBUTE = re.compile(r"\[\[\s*(?P<attr>\w+)\s*(?:\((?P<arg>[^)]*)\))?\s*\]\]")

# Built-ins the emulator's ThreadContext holds, by MSL attribute.
EXTENT_BUILTINS = {
    "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threads_per_threadgroup", "threadgroups_per_grid",
}
SCALAR_BUILTINS = {
    "thread_index_in_threadgroup", "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup", "threads_per_simdgroup",
}


def split_parameters(text):
    depth, current, parameters = 0, "", []
    for char in text:
        if char in "(<[":
            depth += 1
        elif char in ")>]":
            depth -= 1
        if char == "," and depth == 0:
            parameters.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parameters.append(current.strip())
    return parameters


def argument_for(parameter, kernel):
    found = ATTRIBUTE.search(parameter)
    if not found:
        raise SystemExit(f"prep_metal: kernel {kernel}: parameter without attribute: {parameter}")
    attribute, argument = found.group("attr"), found.group("arg")
    declared_type = parameter[: found.start()].rsplit(None, 1)[0]
    if attribute == "buffer":
        index = int(argument)
        holder = "BufferReference" if "&" in declared_type else "BufferPointer"
        return f"::metal_emulator::{holder}{{::metal_emulator::bound_buffer({index})}}"
    base_type = declared_type.replace("const", "").split()[-1]
    if attribute in SCALAR_BUILTINS:
        return f"({base_type})(self.{attribute})"
    if attribute in EXTENT_BUILTINS:
        value = f"self.{attribute}"
        if base_type.endswith("3"):
            return f"::metal::{base_type}({value}.x, {value}.y, {value}.z)"
        if base_type.endswith("2"):
            return f"::metal::{base_type}({value}.x, {value}.y)"
        return f"({base_type})({value}.x)"
    raise SystemExit(f"prep_metal: kernel {kernel}: unsupported attribute [[{attribute}]]")


def find_kernels(source):
    kernels = {}
    for head in KERNEL_HEAD.finditer(source):
        depth, position = 1, head.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[position], 0)
            position += 1
        parameters = split_parameters(source[head.end(): position - 1])
        before = source[: head.start()].rstrip()
        is_template = before.endswith(">") and "template" in before.rsplit("\n", 2)[-1]
        kernels[head.group("name")] = (parameters, is_template)
    return kernels


LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"(?P<path>[^"]+)"', re.MULTILINE)


def check_headers(source, directory, seen):
    for include in LOCAL_INCLUDE.finditer(source):
        path = os.path.join(directory, include["path"])
        if path in seen:
            continue
        seen.add(path)
        with open(path) as handle:
            text = handle.read()
        for number, line in enumerate(text.split("\n"), 1):
            if THREADGROUP_ARRAY.match(line):
                raise SystemExit(f"{path}:{number}: threadgroup arrays belong in the kernel's "
                                 ".metal file, where the emulator's rewrite can see them")
        check_headers(text, os.path.dirname(path), seen)


def main(input_path, output_path):
    with open(input_path) as handle:
        lines = handle.read().split("\n")
    check_headers("\n".join(lines), os.path.dirname(input_path), set())
    out = [f'#line 1 "{input_path}"']
    instantiations = []
    for line in lines:
        instantiation = INSTANTIATION.match(line)
        if instantiation:
            instantiations.append(
                (instantiation["host"], instantiation["function"], instantiation["args"].strip()))
            out.append(line)
            continue
        array = THREADGROUP_ARRAY.match(line)
        if array:
            name = array["name"]
            line = (f"{array['indent']}static {array['decl']}; "
                    f"::metal_emulator::register_threadgroup_array({name}, sizeof({name}));"
                    f"{array['rest']}")
        out.append(THREADGROUP_WORD.sub("", line))

    kernels = find_kernels("\n".join(lines))
    entries = []
    for name, (parameters, is_template) in kernels.items():
        if not is_template:
            entries.append((name, name, parameters))
    for host, function, args in instantiations:
        if function not in kernels:
            raise SystemExit(f"prep_metal: {host} instantiates unknown kernel {function}")
        entries.append((host, f"{function}<{args}>", kernels[function][0]))

    out.append(f'#line 1 "{output_path}.generated"')
    out.append("namespace {")
    for host, callee, parameters in entries:
        arguments = ",\n      ".join(argument_for(p, host) for p in parameters)
        out.append(f"void metal_emulator_entry_{host}() {{")
        out.append("  [[maybe_unused]] auto& self = ::metal_emulator::current_thread();")
        out.append(f"  {callee}(\n      {arguments});")
        out.append("}")
        out.append(f"const ::metal_emulator::KernelRegistration metal_emulator_registration_{host}"
                   f'("{host}", &metal_emulator_entry_{host});')
    out.append("}  // namespace")
    with open(output_path, "w") as handle:
        handle.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
