"""The emulator itself: it must run correct kernels correctly and refuse what
Metal would refuse or what would be undefined on a GPU (divergent barriers,
limits, writes past a buffer). The probe kernels are in
csrc/metal/emulator/probes.metal."""

import _mlx_gated_delta_metal_emulator as _metal_emulator
import numpy as np
import pytest

TIMEOUT_MS = 10_000


def run_probe(
    kernel, threads, data, *, groups=(1, 1, 1), threadgroup_bytes=32768, timeout_ms=TIMEOUT_MS
):
    result = _metal_emulator.run_kernel(
        kernel,
        groups,
        (threads, 1, 1),
        threadgroup_bytes,
        np.asarray(data, np.float32).tobytes(),
        timeout_ms,
    )
    return np.frombuffer(result, np.float32)


def test_threadgroup_memory_and_barriers_work():
    data = np.arange(256, dtype=np.float32)
    assert np.array_equal(run_probe("probe_reverse", 256, data), data[::-1])


def test_simd_collectives_exchange_among_the_32_lanes():
    data = np.arange(64, dtype=np.float32)
    out = run_probe("probe_simd_collectives", 64, data)
    lanes = data.reshape(2, 32)
    expected = lanes.sum(axis=1, keepdims=True) * 1000 + np.roll(lanes, -1, axis=1)
    assert np.array_equal(out, expected.reshape(-1))


def test_barriers_reached_from_two_lines_are_divergence():
    with pytest.raises(
        RuntimeError,
        match=r"divergent threadgroup_barrier: reached from .*probes\.metal:\d+ and from .*probes\.metal:\d+",
    ):
        run_probe("probe_divergent_barrier", 64, np.zeros(64))


def test_a_thread_returning_before_a_barrier_is_divergence():
    with pytest.raises(RuntimeError, match=r"returned from the kernel without reaching it"):
        run_probe("probe_early_return", 64, np.zeros(64))


def test_a_simd_sum_in_divergent_control_flow_is_reported():
    with pytest.raises(RuntimeError, match=r"divergent SIMD-group collective"):
        run_probe("probe_divergent_simd_sum", 32, np.zeros(32))


def test_a_deadlock_times_out_with_an_error():
    with pytest.raises(RuntimeError, match=r"did not complete within 300 ms.*deadlock"):
        run_probe("probe_deadlock", 32, np.zeros(32), timeout_ms=300)


def test_a_launch_over_32_kib_of_threadgroup_memory_is_refused():
    with pytest.raises(
        ValueError, match=r"40960 bytes of threadgroup memory \(Metal allows 32768\)"
    ):
        run_probe("probe_oversized_threadgroup_memory", 64, np.zeros(64), threadgroup_bytes=40960)


def test_threadgroup_memory_beyond_what_the_plan_declares_is_an_error():
    with pytest.raises(
        RuntimeError, match=r"used 40960 bytes of threadgroup memory but its plan declares 32768"
    ):
        run_probe("probe_oversized_threadgroup_memory", 64, np.zeros(64))


def test_more_than_1024_threads_per_threadgroup_are_refused():
    with pytest.raises(ValueError, match=r"1056 threads per threadgroup"):
        run_probe("probe_reverse", 1056, np.zeros(1056))


def test_unwritten_threadgroup_memory_reads_as_nan():
    # Threadgroup memory is poisoned before every threadgroup, so a kernel that
    # relies on memory another threadgroup (or nobody) wrote sees NaN.
    run_probe("probe_reverse", 64, np.ones(64))
    out = run_probe("probe_reads_unwritten_threadgroup_memory", 64, np.zeros(64), groups=(2, 1, 1))
    assert np.isnan(out).all()


def test_a_write_past_the_end_of_a_buffer_hits_the_sentinel_guard():
    with pytest.raises(
        RuntimeError, match=r"probe_write_past_end wrote past its end of buffer data"
    ):
        run_probe("probe_write_past_end", 64, np.zeros(64))


def test_an_unknown_kernel_is_an_error():
    with pytest.raises(ValueError, match="no kernel named 'no_such_kernel'"):
        run_probe("no_such_kernel", 32, np.zeros(32))


@pytest.mark.parametrize("transpose", (False, True))
def test_simdgroup_matrix_multiply_accumulate(transpose):
    # Small integers: every product and sum is exact in float32.
    rng = np.random.default_rng(7)
    a = rng.integers(-8, 9, size=(8, 8)).astype(np.float32)
    b = rng.integers(-8, 9, size=(8, 8)).astype(np.float32)
    data = np.concatenate([a.ravel(), b.ravel(), np.zeros(64), [float(transpose)]])
    out = run_probe("probe_simdgroup_matrix", 32, data)
    expected = a @ (b.T if transpose else b) + 1.0
    assert np.array_equal(out[128:192].reshape(8, 8), expected)


def test_a_simdgroup_store_of_lane_dependent_matrices_is_divergence():
    with pytest.raises(
        RuntimeError,
        match=r"simdgroup_store at .*probes\.metal:\d+: the lanes hold different matrices",
    ):
        run_probe("probe_simdgroup_matrix_divergent_load", 32, np.arange(200))


def test_an_error_in_one_thread_ends_the_dispatch_without_waiting_for_the_timeout():
    # simd_shuffle from lane 40 fails in one thread while the others wait; the
    # barrier timeout is a minute, the error must arrive long before.
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="source lane outside the SIMD-group"):
        run_probe("probe_error_while_others_wait", 64, np.zeros(64), timeout_ms=60_000)
    assert time.monotonic() - start < 10
