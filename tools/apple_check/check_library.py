"""The embedded Metal library through a strict MSL front end.

1. Builds exactly the string the executor hands to MLX's Device::get_library:
   csrc/metal/embed_metal.py writes the generated header (the kernel list is
   METAL_KERNELS of csrc/metal/CMakeLists.txt), and a small C++ program that
   includes it writes kMetalLibrarySource out, so the raw string is read by a
   compiler, not by us.
2. Compiles that text, unchanged, with clang in C++14 mode (MSL 3.1 is C++14
   based), -Wall -Wextra -Werror, no system headers, and the declaration-only
   <metal_stdlib> of tools/apple_check/msl, at the Metal language version MLX
   asks for on its oldest macOS.
3. Checks that every kernel template is instantiated for float, half and bfloat
   (for each combination of its other template arguments) and that every host
   name is unique.
4. Runs lint_kernels.py over the kernel sources.

Usage: check_library.py            check the real library
       check_library.py --probes   check that every probe is rejected with its error
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import lint_kernels  # noqa: E402

KERNEL_DIR = os.path.join(REPO, "csrc", "metal", "kernels")
BUILD_DIR = os.path.join(REPO, "build", "apple_check")
PROBE_DIR = os.path.join(HERE, "probes", "msl")
CLANG = os.environ.get("MLX_GATED_DELTA_CLANG", "clang-19")

# MLX 0.32.4 compiles a source library at MTL::LanguageVersion3_1 on macOS 14,
# the oldest macOS it supports (mlx/backend/metal/device.cpp,
# get_metal_version()); newer systems get newer versions, so 3.1 is the floor.
METAL_VERSION = 310
FLOAT_TYPES = {"float", "half", "bfloat"}

FRONT_END_FLAGS = [
    "-x",
    "c++",
    "-std=c++14",
    "-fsyntax-only",
    # Metal has no C or C++ standard library: nothing but <metal_stdlib> resolves.
    "-nostdinc",
    "-nostdinc++",
    f"-D__METAL_VERSION__={METAL_VERSION}",
    "-Wall",
    "-Wextra",
    "-Werror",
    # MSL's own attributes ([[kernel]], [[buffer(n)]], [[host_name("...")]],
    # [[thread_position_in_grid]] ...) are unknown to C++ clang. They stay in the
    # source and are parsed (a malformed one is still a syntax error); only the
    # "unknown attribute ignored" warning is off.
    "-Wno-unknown-attributes",
    # Every error is reported (clang stops after 20 by default).
    "-ferror-limit=0",
    "-fno-caret-diagnostics",
    "-fno-color-diagnostics",
]

DIAGNOSTIC = re.compile(
    r"^(?P<file>.*?):(?P<line>\d+):(?P<column>\d+): (?P<kind>error|warning|note|fatal error): (?P<message>.*)$"
)


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def kernel_names():
    with open(os.path.join(REPO, "csrc", "metal", "CMakeLists.txt")) as handle:
        match = re.search(r"set\(METAL_KERNELS\s+([^)]*)\)", handle.read())
    return match.group(1).split()


def library_text(kernel_dir, work_dir):
    """The string get_library receives, built from the kernels in kernel_dir."""
    os.makedirs(work_dir, exist_ok=True)
    header = os.path.join(work_dir, "metal_library_source.h")
    kernels = [os.path.join(kernel_dir, f"{name}.metal") for name in kernel_names()]
    embed = run(
        [sys.executable, os.path.join(REPO, "csrc", "metal", "embed_metal.py"), header] + kernels
    )
    if embed.returncode != 0:
        raise RuntimeError(f"embed_metal.py failed:\n{embed.stdout}{embed.stderr}")
    printer = os.path.join(work_dir, "print_library")
    build = run(
        [
            CLANG,
            "-x",
            "c++",
            "-std=c++17",
            f'-DMETAL_LIBRARY_HEADER="{header}"',
            os.path.join(HERE, "print_library.cpp"),
            "-o",
            printer,
        ]
    )
    if build.returncode != 0:
        raise RuntimeError(f"the library printer does not build:\n{build.stderr}")
    library = os.path.join(work_dir, "metal_library.metal")
    printed = run([printer, library])
    if printed.returncode != 0:
        raise RuntimeError(f"the library printer failed:\n{printed.stderr}")
    return library, kernels


SUMMARY = re.compile(r"^\d+ (?:errors?|warnings?)( and \d+ (?:errors?|warnings?))? generated\.$")


def diagnostics(output):
    """Clang's diagnostics as (kind, file, line, message, [(file, line, note)]).

    A line of output that is neither a located diagnostic nor clang's closing
    count (a fatal error without a location, say) becomes an error itself, so
    nothing clang says can pass unread.
    """
    result = []
    for raw in output.splitlines():
        match = DIAGNOSTIC.match(raw)
        if not match:
            if raw.strip() and not SUMMARY.match(raw.strip()):
                result.append(("error", "clang", 0, raw.strip(), []))
            continue
        if match["kind"] == "note" and result:
            result[-1][4].append((match["file"], int(match["line"]), match["message"]))
        elif match["kind"] != "note":
            result.append((match["kind"], match["file"], int(match["line"]), match["message"], []))
    return result


def source_line(path, line, kernel_dir, library):
    """A line of the compiled text, following #line markers to their files."""
    candidates = (
        path,
        os.path.join(REPO, path),
        os.path.join(kernel_dir, os.path.basename(path)),
        library,
    )
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate) as handle:
                lines = handle.read().split("\n")
            return lines[line - 1] if 0 < line <= len(lines) else ""
    return ""


def accepted_divergence(diagnostic, kernel_dir, library):
    """True for the two places where C++ clang rejects what Metal accepts.

    - `template [[host_name(..)]] [[kernel]] decltype(f<T>) f<T>;`: Metal allows
      attributes on an explicit instantiation (MLX's own idiom); C++ clang says
      "an attribute list cannot appear here", then instantiates it all the same.
    - A function parameter in threadgroup memory: the strict header spells
      threadgroup with `static` (see msl/metal_stdlib), which C++ forbids there;
      clang drops the `static` and checks the parameter with its address space.
    """
    kind, path, line, message, notes = diagnostic
    if kind != "error":
        return False
    if message == "an attribute list cannot appear here":
        # The line itself, or the macro it expands, reads `template [[`.
        where = [(path, line)] + [
            (p, n) for p, n, note in notes if note.startswith("expanded from macro")
        ]
        return any(
            source_line(p, n, kernel_dir, library).strip().startswith("template [[")
            for p, n in where
        )
    if message == "invalid storage class specifier in function declarator":
        return any(note == "expanded from macro 'threadgroup'" for _, _, note in notes)
    return False


def front_end(kernel_dir, library):
    result = run([CLANG, *FRONT_END_FLAGS, "-I", os.path.join(HERE, "msl"), library])
    found = diagnostics(result.stderr)
    errors = [d for d in found if not accepted_divergence(d, kernel_dir, library)]
    messages = [f"{path}:{line}: {kind}: {message}" for kind, path, line, message, _ in errors]
    if result.returncode != 0 and not found:
        messages.append(f"clang failed without a diagnostic:\n{result.stderr}")
    return messages


INSTANTIATION = re.compile(
    r'template\s*\[\[\s*host_name\(\s*"(?P<host>[^"]*)"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*'
    r"decltype\(\s*(?P<function>\w+)\s*<(?P<arguments>[^>]*)>\s*\)"
)
KERNEL_TEMPLATE = re.compile(
    r"template\s*<[^{;]*?>\s*\[\[\s*kernel\s*\]\]\s*void\s+(?P<name>\w+)\s*\("
)


def instantiations(library):
    """Every kernel template has float, half and bfloat instantiations; host names are unique."""
    expanded = run(
        [
            CLANG,
            "-E",
            "-P",
            *FRONT_END_FLAGS[:2],
            "-nostdinc",
            "-nostdinc++",
            f"-D__METAL_VERSION__={METAL_VERSION}",
            "-I",
            os.path.join(HERE, "msl"),
            library,
        ]
    )
    if expanded.returncode != 0:
        return [f"preprocessing failed:\n{expanded.stderr}"]
    text = expanded.stdout
    errors, hosts, types = [], {}, {}
    for match in INSTANTIATION.finditer(text):
        host = match["host"]
        hosts[host] = hosts.get(host, 0) + 1
        arguments = [a.strip() for a in match["arguments"].split(",")]
        key = (match["function"], tuple(arguments[1:]))
        types.setdefault(key, set()).add(arguments[0])
    for host, count in sorted(hosts.items()):
        if count > 1:
            errors.append(f"host name '{host}' is instantiated {count} times")
    for kernel in KERNEL_TEMPLATE.finditer(text):
        name = kernel["name"]
        groups = {rest: found for (function, rest), found in types.items() if function == name}
        if not groups:
            errors.append(f"kernel template '{name}' is never instantiated")
        for rest, found in sorted(groups.items()):
            missing = FLOAT_TYPES - found
            if missing:
                others = f" (with {', '.join(rest)})" if rest else ""
                errors.append(
                    f"kernel template '{name}'{others} is instantiated for "
                    f"{', '.join(sorted(found))} but not {', '.join(sorted(missing))}"
                )
    return errors


def check(kernel_dir, work_dir):
    """All the errors of the library built from kernel_dir (paths relative to the repository)."""
    library, kernels = library_text(kernel_dir, work_dir)
    headers = [
        os.path.join(kernel_dir, f) for f in sorted(os.listdir(kernel_dir)) if f.endswith(".h")
    ]
    errors = (
        front_end(kernel_dir, library)
        + instantiations(library)
        + lint_kernels.lint_files(kernels + headers)
    )
    return [error.replace(REPO + os.sep, "") for error in errors]


def run_probe(probe):
    """The errors of one probe: the real kernels with its edits, or its own snippet."""
    work_dir = os.path.join(BUILD_DIR, "probes", probe["name"])
    kernel_dir = os.path.join(work_dir, "kernels")
    shutil.rmtree(work_dir, ignore_errors=True)
    shutil.copytree(KERNEL_DIR, kernel_dir)
    for edit in probe["edits"]:
        path = os.path.join(kernel_dir, edit["file"])
        with open(path) as handle:
            text = handle.read()
        if text.count(edit["old"]) != 1:
            raise RuntimeError(
                f"probe {probe['name']}: {edit['old']!r} is not exactly once "
                f"in {edit['file']}: the probe no longer matches the kernels"
            )
        with open(path, "w") as handle:
            handle.write(text.replace(edit["old"], edit["new"]))
    return check(kernel_dir, os.path.join(work_dir, "out"))


def load_probes():
    with open(os.path.join(PROBE_DIR, "probes.json")) as handle:
        return json.load(handle)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--probes",
        action="store_true",
        help="check that every probe is rejected with its expected error",
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    if not args.probes:
        errors = check(KERNEL_DIR, BUILD_DIR)
        for error in errors:
            print(error)
        verdict = "FAILED" if errors else "passed"
        print(
            f"check_library: the embedded Metal library {verdict} "
            f"(MSL {METAL_VERSION // 100}.{METAL_VERSION // 10 % 10}, "
            f"{len(kernel_names())} kernel files, {time.monotonic() - start:.1f} s)"
        )
        return 1 if errors else 0
    failed = 0
    for probe in load_probes():
        errors = run_probe(probe)
        matching = [e for e in errors if probe["expect"] in e]
        if matching:
            print(f"probe {probe['name']}: rejected as expected: {matching[0]}")
        else:
            failed += 1
            got = "\n    ".join(errors) if errors else "(no error: the check passed it)"
            print(f"probe {probe['name']}: NOT rejected with {probe['expect']!r}; got:\n    {got}")
    print(
        f"check_library --probes: {len(load_probes()) - failed} of {len(load_probes())} "
        f"probes rejected as expected ({time.monotonic() - start:.1f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
