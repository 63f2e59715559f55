"""Checks a link map of the extension: no code of a wide kernel level runs outside it.

The CPU kernels are compiled once per instruction-set level, each copy in its
own namespace (csrc/cpu/kernel_level.h). A function that several objects
define alike (an inline function or a template outside those namespaces,
std::vector<float>'s say) is linked once, from the first object on the link
line that defines it, and every object that calls it calls that copy. A
compiler emits such a function in every object that calls it out of line, so
with the objects in ascending level order (CMakeLists.txt puts the baseline's
first) the copy kept is the lowest level's that calls it: it runs on every CPU
that runs a caller. This reads the linker's map (-Wl,-Map) and fails where that
order does not hold: where a wide level's copy of a shared function was kept
and a lower level's (or the rest of the module's) thrown away. It fails, too,
on a static initializer of a wide level's object, which would run when the
module loads, on any CPU.

A map from another linker (lld, gold) is not read: the script says so and
passes.

Usage: python tools/check_kernel_levels.py MAP_FILE
"""

from __future__ import annotations

import re
import sys

# The levels above the baseline, as they appear in object paths
# (gated_delta_kernels_<level>.dir) and in mangled names (<length><level>).
WIDE_LEVELS = ("x86_64_v3", "x86_64_v4")

_INPUT = re.compile(r"^ (\.\S+)(?:\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(\S.*))?$")
_CONTINUED = re.compile(r"^\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+(\S.*)$")
# Input sections whose code runs without being called by name: static
# initializers and finalizers.
_RUN_AT_LOAD = (".text.startup", ".text.exit", ".init_array", ".fini_array", ".ctors", ".dtors")


def _input_sections(lines: list[str]) -> list[tuple[str, int, str]]:
    """(section name, size, object path) of each input section listed in lines."""
    sections = []
    pending = None
    for line in lines:
        if pending is not None:
            continued = _CONTINUED.match(line)
            if continued:
                sections.append((pending, int(continued.group(2), 16), continued.group(3).strip()))
            pending = None
            continue
        match = _INPUT.match(line)
        if not match:
            continue
        if match.group(2) is None:
            pending = match.group(1)  # a long name: address, size and object follow
        else:
            sections.append((match.group(1), int(match.group(3), 16), match.group(4).strip()))
    return sections


def discarded_and_kept(
    map_text: str,
) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """The input sections the link threw away, and those it kept."""
    lines = map_text.splitlines()
    try:
        discarded_at = lines.index("Discarded input sections")
        kept_at = lines.index("Linker script and memory map")
    except ValueError:
        raise ValueError("not a GNU ld link map") from None
    return _input_sections(lines[discarded_at + 1 : kept_at]), _input_sections(lines[kept_at + 1 :])


def level_of(path: str) -> int:
    """0 for the baseline's objects and the rest of the module, else 1 + the wide level's index."""
    for index, level in enumerate(WIDE_LEVELS):
        if f"gated_delta_kernels_{level}.dir" in path:
            return index + 1
    return 0


def foreign_code(map_text: str) -> list[str]:
    """Each kept section of a wide level's object that may run outside that level."""
    discarded, kept = discarded_and_kept(map_text)
    lowest_discarded: dict[str, int] = {}
    for name, _, path in discarded:
        # .text.<mangled name> holds one function that several objects may
        # define; .text, .text.unlikely and .text.hot an object's own code.
        if name.startswith(".text") and "._Z" in name:
            lowest_discarded[name] = min(
                lowest_discarded.get(name, len(WIDE_LEVELS)), level_of(path)
            )
    problems = []
    for name, size, path in kept:
        level = level_of(path)
        if level == 0 or size == 0:
            continue
        if name.startswith(_RUN_AT_LOAD):
            problems.append(f"{path}: {name} runs when the module loads, on any CPU")
        elif name in lowest_discarded and lowest_discarded[name] < level:
            problems.append(
                f"{path}: {name} was kept from the {WIDE_LEVELS[level - 1]} copy, "
                "and a lower level's copy was thrown away"
            )
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8", errors="replace") as f:
        map_text = f.read()
    try:
        problems = foreign_code(map_text)
    except ValueError:
        # Another linker (lld, gold) writes its map in another form.
        print(
            f"check_kernel_levels: not checked: {argv[1]} is not a GNU ld link map",
            file=sys.stderr,
        )
        return 0
    for problem in problems:
        print(f"check_kernel_levels: {problem}", file=sys.stderr)
    if problems:
        print(
            "check_kernel_levels: the baseline's objects must come first on the link line "
            "(CMakeLists.txt), and a kernel source may not define a static object with a "
            "constructor",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
