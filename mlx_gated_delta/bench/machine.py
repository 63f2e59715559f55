"""The machine a benchmark runs on: its rooflines, measured in the same run (copy bandwidth,
float32 GEMM FLOP/s through NumPy's BLAS), its caches and memory, and the provenance a record
keeps (CPU, load, commit, versions)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import _ext, thread_count
from .timing import median_seconds

MiB = 1 << 20


def measure_copy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 7) -> dict:
    """NumPy ``copyto`` of ``nbytes``: bytes read + written per second.

    Measured on one thread and split over the usable CPUs (our kernels use them all, so the
    larger of the two is the roofline they are held to).
    """
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    moved = 2 * src.nbytes
    one_thread = moved / median_seconds(lambda: np.copyto(dst, src), repeats)

    cores = usable_cpus()
    bounds = np.linspace(0, src.size, cores + 1).astype(np.int64)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(cores) as pool:  # copyto releases the GIL

        def copy_all_cores():
            list(pool.map(lambda p: np.copyto(*p), parts))

        all_cores = moved / median_seconds(copy_all_cores, repeats)
    return {
        "bytes_copied": src.nbytes,
        "one_thread_bytes_per_s": one_thread,
        "all_cores_bytes_per_s": all_cores,
        "threads": cores,
        "bytes_per_s": max(one_thread, all_cores),
    }


def measure_gemm_flops(n: int = 2048, repeats: int = 7) -> dict:
    """Warm float32 ``n x n`` matrix product through NumPy's BLAS: FLOP per second."""
    rng = np.random.default_rng(1)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)  # a cold first call is far slower; keep it out of the median
    seconds = median_seconds(lambda: np.matmul(a, b, out=c), repeats)
    return {"n": n, "flop_per_s": 2 * n**3 / seconds}


def measure_rooflines() -> dict:
    """Both rooflines, measured now."""
    return {"copy": measure_copy_bandwidth(), "gemm": measure_gemm_flops()}


def best_rooflines(before: dict, after: dict) -> dict:
    """The higher of the two measurements of each roofline: a neighbour's load during one of
    them must not make our fraction of the machine look better than it is."""
    return {
        "copy": max(before["copy"], after["copy"], key=lambda m: m["bytes_per_s"]),
        "gemm": max(before["gemm"], after["gemm"], key=lambda m: m["flop_per_s"]),
        "before_rows": before,
        "after_rows": after,
    }


def last_level_cache_bytes() -> int | None:
    """Size of the largest data/unified cache of CPU 0 from sysfs, or None if unreadable."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = value if best is None else max(best, value)
    return best


def usable_cpus() -> int:
    """The CPUs this process may use, as the CPU pool reads them: its affinity mask, bounded by
    its cgroup's CPU quota (MLX_GATED_DELTA_NUM_THREADS aside)."""
    from .. import _ext

    budget = _ext.cpu_thread_budget()
    return min(budget["affinity_cpus"], budget["quota_cpus"] or budget["affinity_cpus"])


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        return subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"


def load_average() -> float | None:
    """The 1-minute load average: how many other runnable tasks shared the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def git_commit() -> str:
    """The commit of the checkout the benchmark script runs from (``+dirty`` when it has
    uncommitted changes), or "unknown" outside a git checkout (an installed package)."""
    script = Path(sys.argv[0]).resolve()
    where = script.parent if script.is_file() else Path.cwd()

    def git(*args):
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=where, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def command_line() -> str:
    """The benchmark's command as its user typed it, naming no path of the machine: the
    package's entry (`python -m mlx_gated_delta`, whose argv[0] is the full path of
    `__main__.py`) by its module, a script by its file name."""
    entry = Path(sys.argv[0])
    if entry.name == "__main__.py" and entry.parent.name == "mlx_gated_delta":
        program = "python -m mlx_gated_delta"
    else:
        program = entry.name
    return " ".join([program, *sys.argv[1:]])


def cpu_run_record(load_before: float | None) -> dict:
    """The head of a CPU benchmark's record, taken when its rows are done: when, the
    command, the machine (cores, the pool's threads, the kernel level, the load before and
    now), MLX's version and the commit."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "machine": {
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "cpu_threads": thread_count(),
            "cpu_kernel_level": _ext.cpu_kernel_level(),
            "load_before": load_before,
            "load_after": load_average(),
        },
        "versions": {"mlx": mx.__version__},
        "git_commit": git_commit(),
    }


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
