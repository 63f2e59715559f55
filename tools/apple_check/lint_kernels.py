"""The kernel-signature rules of MSL that a C++ front end cannot check.

For every `[[kernel]]` (or `kernel`) function of the given .metal files:
  - a pointer or reference parameter names its address space (device, constant
    or threadgroup: a kernel cannot take thread memory) and carries the
    attribute binding it: [[buffer(n)]] for device and constant,
    [[threadgroup(n)]] for threadgroup;
  - any other parameter is a built-in input with its attribute
    ([[thread_position_in_grid]] ...) and an integer scalar or vector type;
  - no buffer (or threadgroup) index is bound twice in one kernel;
and a threadgroup variable is declared only in a kernel function's body (the
strict front end cannot see this: its `threadgroup` is `static`, legal anywhere).

Usage: lint_kernels.py FILE...   (errors as FILE:LINE: message; exit 1 if any)
"""

import re
import sys

KERNEL = re.compile(r"(?:\[\[\s*kernel\s*\]\]|\bkernel\b)\s*void\s+(?P<name>\w+)\s*\(")
ATTRIBUTE = re.compile(r"\[\[\s*(?P<name>\w+)\s*(?:\((?P<argument>[^)]*)\))?\s*\]\]")
ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")
# MSL's kernel-function input attributes (the Metal Shading Language
# Specification, "Attributes for Kernel Function Input Arguments").
BUILT_INS = {
    "dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "grid_origin",
    "grid_size",
    "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
    "thread_index_in_quadgroup",
    "thread_index_in_simdgroup",
    "thread_index_in_threadgroup",
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "threads_per_grid",
    "threads_per_simdgroup",
    "threads_per_threadgroup",
}
# A threadgroup variable (not a pointer or reference to threadgroup memory).
THREADGROUP_VARIABLE = re.compile(
    r"\bthreadgroup\s+(?:const\s+)?\w+(?:\s*<[^;>]*>)?\s+(?P<name>\w+)\s*(?:\[[^\];]*\]\s*)*;"
)
BUILT_IN_TYPES = {"uint", "ushort", "uint2", "uint3", "ushort2", "ushort3"}


def strip_comments(text):
    """The text with comments blanked (newlines kept, so offsets keep their lines)."""

    def blank(match):
        return re.sub(r"[^\n]", " ", match.group(0))

    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, text, flags=re.S)


def split_parameters(text, start):
    """(offset, text) of each parameter of the list opening just before `start`."""
    depth, begin, parameters = 0, start, []
    for at in range(start, len(text)):
        char = text[at]
        if char in "([<":
            depth += 1
        elif char in ")]>":
            if depth == 0 and char == ")":
                parameters.append((begin, text[begin:at]))
                return parameters
            depth -= 1
        elif char == "," and depth == 0:
            parameters.append((begin, text[begin:at]))
            begin = at + 1
    raise ValueError("unterminated parameter list")


def body_span(text, start):
    """(begin, end) of the braces of the function body that opens after `start`."""
    begin = text.index("{", start)
    depth = 0
    for at in range(begin, len(text)):
        if text[at] == "{":
            depth += 1
        elif text[at] == "}":
            depth -= 1
            if depth == 0:
                return begin, at
    raise ValueError("unterminated function body")


def lint_text(path, text):
    text = strip_comments(text)
    errors = []

    def line_of(offset):
        return text.count("\n", 0, offset) + 1

    bodies = []
    for kernel in KERNEL.finditer(text):
        name = kernel["name"]
        bound = {}  # (attribute, index) -> line
        parameters = split_parameters(text, kernel.end())
        last_offset, last = parameters[-1]
        bodies.append(body_span(text, last_offset + len(last)))
        for offset, parameter in parameters:
            leading = len(parameter) - len(parameter.lstrip())
            line = line_of(offset + leading)
            where = f"{path}:{line}: kernel '{name}'"
            attributes = {m["name"]: m["argument"] for m in ATTRIBUTE.finditer(parameter)}
            declaration = ATTRIBUTE.sub(" ", parameter)
            words = re.findall(r"\w+", declaration)
            if not words:
                errors.append(f"{where}: empty parameter")
                continue
            parameter_name = words[-1]
            spaces = [w for w in words if w in ADDRESS_SPACES]
            built_ins = [a for a in attributes if a in BUILT_INS]
            if "*" in declaration or "&" in declaration:
                if not spaces:
                    errors.append(
                        f"{where}: pointer or reference parameter '{parameter_name}' has no "
                        "address space (device, constant or threadgroup)"
                    )
                    continue
                if spaces != ["device"] and spaces != ["constant"] and spaces != ["threadgroup"]:
                    errors.append(
                        f"{where}: parameter '{parameter_name}' must be in exactly one of "
                        f"device, constant or threadgroup memory, not {' '.join(spaces)}"
                    )
                    continue
                binding = "threadgroup" if spaces == ["threadgroup"] else "buffer"
                index = attributes.get(binding)
                if index is None or not index.strip().isdigit():
                    errors.append(
                        f"{where}: {spaces[0]} parameter '{parameter_name}' needs a "
                        f"[[{binding}(n)]] attribute"
                    )
                    continue
                key = (binding, int(index))
                if key in bound:
                    errors.append(
                        f"{where}: parameter '{parameter_name}' binds {binding}({index}), "
                        f"already bound on line {bound[key]}"
                    )
                bound[key] = line
            elif built_ins:
                if len(built_ins) > 1:
                    errors.append(
                        f"{where}: parameter '{parameter_name}' has several built-in attributes"
                    )
                type_words = [w for w in words[:-1] if w != "const"]
                if len(type_words) != 1 or type_words[0] not in BUILT_IN_TYPES:
                    errors.append(
                        f"{where}: built-in parameter '{parameter_name}' "
                        f"[[{built_ins[0]}]] must be one of {', '.join(sorted(BUILT_IN_TYPES))}"
                    )
            else:
                errors.append(
                    f"{where}: parameter '{parameter_name}' is neither a pointer or reference "
                    "with an address space nor a built-in with its attribute"
                )
    for variable in THREADGROUP_VARIABLE.finditer(text):
        if not any(begin < variable.start() < end for begin, end in bodies):
            errors.append(
                f"{path}:{line_of(variable.start())}: threadgroup variable '{variable['name']}' "
                "outside a kernel function (MSL declares threadgroup memory in kernels only)"
            )
    return errors


def lint_files(paths):
    errors = []
    for path in paths:
        with open(path) as handle:
            errors += lint_text(path, handle.read())
    return errors


def main(paths):
    errors = lint_files(paths)
    for error in errors:
        print(error)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
