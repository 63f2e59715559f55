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
  expands to, attributes included, as Metal's compiler does. The host names
  are read off that expansion (the C preprocessor on the real macro), so a
  malformed instantiation macro fails the emulator build. Each instantiation,
  and each non-template kernel, gets a generated entry point that passes the
  bound buffers and the built-in positions as ordinary arguments, registered
  under its host name.

Usage: prep_metal.py INPUT.metal OUTPUT.cpp
"""

import os
import re
import subprocess
import sys

THREADGROUP_ARRAY = re.compile(
    r"^(?P<indent>\s*)threadgroup\s+(?P<decl>[^;]*?\b(?P<name>\w+)\s*\[[^;]*\])\s*;(?P<rest>.*)$"
)
THREADGROUP_WORD = re.compile(r"\bthreadgroup\b(?!_)\s*")
INSTANTIATION = re.compile(r"^\s*instantiate_kernel\(.*\)\s*$")
MACRO_DEFINITION = re.compile(r"^\s*#\s*define\s+instantiate_kernel\b")
# What one instantiation must expand to for Metal to export the kernel under
# its host name.
EXPANSION = re.compile(
    r'^template \[\[host_name\("(?P<host>\w+)"\)\]\] \[\[kernel\]\] '
    r"decltype\((?P<function>\w+)<(?P<args>[^<>]*)>\) (?P=function)<(?P=args)>;$"
)
KERNEL_HEAD = re.compile(r"(?:\[\[kernel\]\]|\bkernel)\s+void\s+(?P<name>\w+)\s*\(")
ATTRIBUTE = re.compile(r"\[\[\s*(?P<attr>\w+)\s*(?:\((?P<arg>[^)]*)\))?\s*\]\]")

# Built-ins the emulator's ThreadContext holds, by MSL attribute.
EXTENT_BUILTINS = {
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
}
SCALAR_BUILTINS = {
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
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
        parameters = split_parameters(source[head.end() : position - 1])
        before = source[: head.start()].rstrip()
        is_template = before.endswith(">") and "template" in before.rsplit("\n", 2)[-1]
        kernels[head.group("name")] = (parameters, is_template)
    return kernels


LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"(?P<path>[^"]+)"', re.MULTILINE)


def check_headers(source, directory, seen):
    """The texts of the local headers `source` includes, directly or not;
    checks that they declare no threadgroup arrays."""
    texts = []
    for include in LOCAL_INCLUDE.finditer(source):
        path = os.path.join(directory, include["path"])
        if path in seen:
            continue
        seen.add(path)
        with open(path) as handle:
            text = handle.read()
        for number, line in enumerate(text.split("\n"), 1):
            if THREADGROUP_ARRAY.match(line):
                raise SystemExit(
                    f"{path}:{number}: threadgroup arrays belong in the kernel's "
                    ".metal file, where the emulator's rewrite can see them"
                )
        texts.append(text)
        texts += check_headers(text, os.path.dirname(path), seen)
    return texts


def macro_definition(texts):
    """The text of `#define instantiate_kernel`, continuation lines included."""
    for text in texts:
        lines = text.split("\n")
        for number, line in enumerate(lines):
            if MACRO_DEFINITION.match(line):
                end = number
                while lines[end].rstrip().endswith("\\"):
                    end += 1
                return "\n".join(lines[number : end + 1])
    raise SystemExit("prep_metal: no #define instantiate_kernel in the kernel or its headers")


def expand_instantiations(path, calls, texts):
    """(host, function, args) of each `instantiate_kernel(...)` call, read off
    what the kernels' own macro expands to under the C preprocessor: the
    host name is the one Metal would export, and a macro that does not expand
    to a host-named kernel instantiation stops the build."""
    if not calls:
        return []
    preprocessor = os.environ.get("CXX", "c++")
    source = macro_definition(texts) + "\n" + "\n".join(calls) + "\n"
    result = subprocess.run(
        [preprocessor, "-E", "-P", "-x", "c++", "-"], input=source, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(
            f"prep_metal: {path}: preprocessing the instantiations failed:\n" + result.stderr
        )
    expansions = [line.strip() for line in result.stdout.split("\n") if line.strip()]
    if len(expansions) != len(calls):
        raise SystemExit(
            f"prep_metal: {path}: {len(calls)} instantiations expanded to {len(expansions)} lines"
        )
    instantiations = []
    for call, expansion in zip(calls, expansions):
        found = EXPANSION.match(expansion)
        if not found:
            raise SystemExit(
                f"prep_metal: {path}: {call.strip()}\n  expands to {expansion}\n"
                "  which is not a host-named [[kernel]] instantiation"
            )
        instantiations.append((found["host"], found["function"], found["args"].strip()))
    return instantiations


def main(input_path, output_path):
    with open(input_path) as handle:
        text = handle.read()
    lines = text.split("\n")
    headers = check_headers(text, os.path.dirname(input_path), set())
    out = [f'#line 1 "{input_path}"']
    calls = []
    for line in lines:
        if INSTANTIATION.match(line):
            calls.append(line)
            out.append(line)
            continue
        array = THREADGROUP_ARRAY.match(line)
        if array:
            name = array["name"]
            line = (
                f"{array['indent']}static {array['decl']}; "
                f"::metal_emulator::register_threadgroup_array({name}, sizeof({name}));"
                f"{array['rest']}"
            )
        out.append(THREADGROUP_WORD.sub("", line))

    instantiations = expand_instantiations(input_path, calls, [text, *headers])
    kernels = find_kernels(text)
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
        out.append(
            f"const ::metal_emulator::KernelRegistration metal_emulator_registration_{host}"
            f'("{host}", &metal_emulator_entry_{host});'
        )
    out.append("}  // namespace")
    with open(output_path, "w") as handle:
        handle.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
