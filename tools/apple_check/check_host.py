"""Syntax-checks every C++ translation unit that is compiled under _METAL_ (the
Metal executor and the GPU branches of the primitives) against MLX's own macOS
headers, with Debian's clang-19, as arm64 twice: with libstdc++ and with libc++.

It proves that the Apple-only C++ lines name real MLX and metal-cpp APIs with
the right arguments and types. It is a front-end check, not Apple's compiler
and not a link (see tools/apple_check/README.md).

Usage:
    python tools/apple_check/check_host.py            # the translation units
    python tools/apple_check/check_host.py --probes   # the probes it must reject

Prints one PASS/FAIL line per translation unit (or probe) and mode, with its
wall time; exits nonzero on any failure.
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fetch_mlx_headers  # noqa: E402

REPO = fetch_mlx_headers.REPO
BUILD = fetch_mlx_headers.BUILD
CSRC = os.path.join(REPO, "csrc")
STUBS = os.path.join(HERE, "stubs")
PROBES = os.path.join(HERE, "probes", "host")
GENERATED = os.path.join(BUILD, "generated")
CLANG = "clang-19"

# What the compiler is told about the platform. macOS on Apple silicon is an
# arm64 target, so both modes target aarch64 (Debian's cross glibc headers
# stand in for the macOS C library) and define __arm64__, the name Apple's
# clang predefines there and metal-cpp tests (on arm64 it calls objc_msgSend
# only; without it metal-cpp takes its x86 or "unsupported architecture"
# branch). __APPLE__ is not defined: no header these translation units
# reach tests it (MLX's headers do not, metal-cpp tests only __arm64__ and
# __OBJC__), while the C++ libraries used here would switch to Darwin paths
# the Linux sysroot lacks (libc++ then includes <xlocale.h>). __OBJC__ stays undefined, as in any C++
# file on a Mac. The macOS availability macros (__MAC_OS_X_VERSION_MIN_REQUIRED,
# __MAC_26_0) and TargetConditionals' switches are read only in metal-cpp's
# *_PRIVATE_IMPLEMENTATION sections, which these files do not compile.
# -fblocks: metal-cpp declares Objective-C block types (`void (^)(...)`).
COMMON_FLAGS = [
    "-fsyntax-only",
    "-std=c++20",
    "-fblocks",
    "-D_METAL_",
    "-Wall",
    "-Werror",
    "--target=aarch64-linux-gnu",
    "-D__arm64__=1",
]
MODES = {
    # libstdc++ 12's std::bind names the deprecated std::result_of, and clang
    # reports that against the caller's lambda (GCC bug 114394), here MLX's
    # cpu::CommandEncoder::dispatch. Undefining __DEPRECATED removes only the
    # standard library's own deprecation markers in this mode; the libc++
    # mode, the library macOS uses, keeps them.
    "arm64-libstdc++": ["-U__DEPRECATED"],
    "arm64-libc++": ["-stdlib=libc++"],
}

# A TU is compiled under _METAL_ if a preprocessor conditional tests it.
METAL_CONDITIONAL = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif)\b.*\b_METAL_\b", re.MULTILINE)
TU_SUFFIXES = (".cpp", ".cc", ".mm")


def metal_translation_units():
    """Every C++ source under csrc/ with a conditional on _METAL_, repo-relative."""
    units = []
    for directory, _, names in os.walk(CSRC):
        for name in sorted(names):
            if name.endswith(TU_SUFFIXES):
                path = os.path.join(directory, name)
                with open(path) as handle:
                    if METAL_CONDITIONAL.search(handle.read()):
                        units.append(os.path.relpath(path, REPO))
    if not units:
        raise SystemExit(
            "check_host: no translation unit under csrc/ tests _METAL_; "
            "the check would check nothing"
        )
    return sorted(units)


def metal_kernels():
    """The kernel list of csrc/metal/CMakeLists.txt (METAL_KERNELS)."""
    with open(os.path.join(CSRC, "metal", "CMakeLists.txt")) as handle:
        match = re.search(r"set\(\s*METAL_KERNELS\s+([^)]*)\)", handle.read())
    if not match or not match[1].split():
        raise SystemExit("check_host: no set(METAL_KERNELS ...) in csrc/metal/CMakeLists.txt")
    return match[1].split()


def generate_library_header():
    """Writes metal/metal_library_source.h the way the macOS build does."""
    output = os.path.join(GENERATED, "metal", "metal_library_source.h")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    kernels = [os.path.join(CSRC, "metal", "kernels", f"{name}.metal") for name in metal_kernels()]
    subprocess.run(
        [sys.executable, os.path.join(CSRC, "metal", "embed_metal.py"), output, *kernels],
        check=True,
    )


def include_flags(mlx_include):
    # MLX's headers are system headers, as in the real build (CMake marks an
    # imported target's include directories SYSTEM), so -Werror applies to our
    # code and not to theirs. Same order as MLX's CMake package: metal_cpp first.
    return [
        "-I",
        CSRC,
        "-I",
        GENERATED,
        "-isystem",
        STUBS,
        "-isystem",
        os.path.join(mlx_include, "metal_cpp"),
        "-isystem",
        mlx_include,
    ]


def compile_unit(source, mode, includes, extra=()):
    """Runs clang on `source`; returns (ok, seconds, diagnostics)."""
    command = [CLANG, *COMMON_FLAGS, *MODES[mode], *includes, *extra, source]
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    return result.returncode == 0, time.monotonic() - start, result.stderr


def parse_probe(path):
    """A probe file: `key: value` lines (source, replace, with, error); `#` comments."""
    fields = {}
    with open(path) as handle:
        for line in handle:
            if line.strip() and not line.startswith("#"):
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    missing = {"source", "replace", "with", "error"} - fields.keys()
    if missing:
        raise SystemExit(f"check_host: probe {path} lacks {sorted(missing)}")
    return fields


def probe_files():
    names = sorted(name for name in os.listdir(PROBES) if name.endswith(".probe"))
    if not names:
        raise SystemExit(f"check_host: no probes in {os.path.relpath(PROBES, REPO)}")
    return [os.path.join(PROBES, name) for name in names]


def make_probe_source(probe, name):
    """A copy of the probe's real source with the one substitution applied.

    A #line directive keeps the real file's name and line numbers, so the
    error the probe expects is reported in the real file."""
    with open(os.path.join(REPO, probe["source"])) as handle:
        text = handle.read()
    count = text.count(probe["replace"])
    if count != 1:
        raise SystemExit(
            f"check_host: probe {name}: the text to replace occurs {count} times in "
            f"{probe['source']} (it must occur once; update the probe)"
        )
    patched = os.path.join(BUILD, "probes", f"{name}.cpp")
    os.makedirs(os.path.dirname(patched), exist_ok=True)
    with open(patched, "w") as handle:
        handle.write(f'#line 1 "{probe["source"]}"\n')
        handle.write(text.replace(probe["replace"], probe["with"]))
    return patched


def compile_probe(probe, name, mode, includes):
    """compile_unit on the probe's patched copy of its source."""
    patched = make_probe_source(probe, name)
    # Quoted includes resolve next to the real source, as they would unpatched.
    extra = ["-iquote", os.path.dirname(os.path.join(REPO, probe["source"]))]
    return compile_unit(patched, mode, includes, extra)


def probe_verdict(probe, ok, diagnostics):
    """(rejected, first error line): rejected for the expected reason means the
    first error is in the probe's real source file and carries its message."""
    error = next((line for line in diagnostics.splitlines() if ": error: " in line), None)
    rejected = (
        not ok
        and error is not None
        and error.startswith(probe["source"] + ":")
        and probe["error"] in error
    )
    return rejected, error


def run_units(includes, pool):
    jobs = {
        (unit, mode): pool.submit(compile_unit, unit, mode, includes)
        for unit in metal_translation_units()
        for mode in MODES
    }
    failures = 0
    for (unit, mode), job in jobs.items():
        ok, seconds, diagnostics = job.result()
        print(f"{'PASS' if ok else 'FAIL'}  {unit}  [{mode}]  {seconds:.1f} s", flush=True)
        if not ok:
            failures += 1
            print(diagnostics, end="", flush=True)
    return failures


def run_probes(includes, pool):
    jobs = {}
    for path in probe_files():
        name = os.path.splitext(os.path.basename(path))[0]
        probe = parse_probe(path)
        for mode in MODES:
            jobs[(name, mode)] = (probe, pool.submit(compile_probe, probe, name, mode, includes))
    failures = 0
    for (name, mode), (probe, job) in jobs.items():
        ok, seconds, diagnostics = job.result()
        rejected, error = probe_verdict(probe, ok, diagnostics)
        print(
            f"{'PASS' if rejected else 'FAIL'}  probe {name}  [{mode}]  {seconds:.1f} s", flush=True
        )
        if rejected:
            print(f"      rejected: {error}", flush=True)
        else:
            failures += 1
            what = "compiled" if ok else f"failed otherwise: {error}"
            print(f"      expected '{probe['error']}' in {probe['source']}; {what}", flush=True)
            if not ok:
                print(diagnostics, end="", flush=True)
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--probes",
        action="store_true",
        help="compile the probes, which must each fail with their error",
    )
    args = parser.parse_args()

    if shutil.which(CLANG) is None:
        raise SystemExit(
            f"check_host: {CLANG} not found (Debian: apt-get install clang-19 "
            "libc++-19-dev libc6-dev-arm64-cross libstdc++-12-dev-arm64-cross)"
        )
    start = time.monotonic()
    includes = include_flags(fetch_mlx_headers.fetch(fetch_mlx_headers.pinned_mlx_version()))
    generate_library_header()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        failures = run_probes(includes, pool) if args.probes else run_units(includes, pool)
    print(
        f"{'FAILED' if failures else 'OK'}: {failures} failure(s), "
        f"{time.monotonic() - start:.1f} s in all",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
