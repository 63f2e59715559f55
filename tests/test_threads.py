"""Thread stress: Python threads, each on its own stream, mixing prefill,
token-by-token decode and the fused segment; every result must be bitwise
the result of the same call run serially on the default stream. Below, the
CPU thread pool on its own: parallel_for runs each index exactly once, from
one caller and from several at once.

MLX_GATED_DELTA_THREAD_ROUNDS sets the rounds per thread (default 3); the
longer run of the reliability notes used 50.
"""

import os
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_gated_delta import _ext, gated_delta_rule, gated_delta_segment, thread_count
from mlx_gated_delta.testing.guarded import run_core_backward_guarded
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.testing.strategies import make_core_case
from mlx_gated_delta.tests.test_core import ALGORITHMS
from mlx_gated_delta.tests.test_core_gradients import cotangents

THREADS = 8
ROUNDS = int(os.environ.get("MLX_GATED_DELTA_THREAD_ROUNDS", "3"))
# parallel_for runs a count of 0 not at all, 1 on the caller alone, and more
# on the caller and every worker, each taking the next free index. Its thread
# count is the machine's (no parameter); 0 to 17 covers each path and counts
# below, at and above the thread counts of small machines.
POOL_COUNTS = range(18)
POOL_CALLERS = 4
# Each task call of the concurrent test sleeps this long, so that one call
# still holds the pool when another Python thread takes the GIL and calls in:
# with instant tasks the calls seldom overlap.
POOL_TASK_SLEEP_US = 20


def workloads(index):
    """Three jobs per thread index, on inputs of their own: a prefill (both
    algorithms, scalar and per-key gates), a prefill then 6 decode steps, a segment call."""
    case = make_core_case(
        index,
        batch=2,
        tokens=70 + index,
        key_heads=2,
        value_heads=4,
        key_dim=32,
        value_dim=16,
        decay="mixed",
        wipes="runs",
        mask_kind="random",
    )
    segment = make_segment_case(
        100 + index,
        batch=2,
        tokens=65,
        key_heads=1,
        value_heads=2,
        key_dim=16,
        value_dim=8,
        wipes="chunk_edges",
        mask_kind="left_padding",
    )

    per_key = make_core_case(
        200 + index,
        batch=2,
        tokens=70 + index,
        key_heads=2,
        value_heads=4,
        key_dim=32,
        value_dim=16,
        decay="mixed",
        wipes="runs",
        mask_kind="random",
        per_key_gates=True,
    )

    def prefill(stream):
        results = []
        for algorithm in ("recurrent", "chunked"):
            for c in (case, per_key):
                results += gated_delta_rule(
                    *c.args(), algorithm=algorithm, stream=stream, **c.options
                )
        return results

    def decode(stream):
        tokens = case.q.shape[1]
        y, state = gated_delta_rule(
            *(x[:, : tokens - 6] for x in case.args()[:5]),
            case.state,
            stream=stream,
            **{**case.options, "mask": case.options["mask"][:, : tokens - 6]},
        )
        results = [y]
        for t in range(tokens - 6, tokens):
            y, state = gated_delta_rule(
                *(x[:, t : t + 1] for x in case.args()[:5]),
                state,
                stream=stream,
                **{**case.options, "mask": case.options["mask"][:, t : t + 1]},
            )
            results.append(y)
        return [*results, state]

    def fused(stream):
        return list(gated_delta_segment(*segment.args(), stream=stream, **segment.options))

    return (prefill, decode, fused)


def evaluated(results):
    mx.eval(results)
    return [
        np.array(r.astype(mx.float32)) if r.dtype == mx.bfloat16 else np.array(r) for r in results
    ]


def test_eight_threads_on_their_own_streams_give_the_serial_results():
    jobs = [workloads(i) for i in range(THREADS)]
    serial = [
        [evaluated(job(mx.default_stream(mx.default_device()))) for job in per_thread]
        for per_thread in jobs
    ]
    mismatches, errors, jobs_done = [], [], []

    def worker(index):
        try:
            stream = mx.new_stream(mx.default_device())
            for round_ in range(ROUNDS):
                # Each thread walks its jobs in another order.
                order = np.roll(np.arange(3), index + round_)
                for j in order:
                    got = evaluated(jobs[index][j](stream))
                    for n, (a, b) in enumerate(zip(got, serial[index][j])):
                        if a.dtype != b.dtype or not np.array_equal(a, b, equal_nan=True):
                            mismatches.append((index, round_, int(j), n))
                    jobs_done.append(len(got))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append((index, repr(error)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert not errors, errors
    assert not mismatches, f"(thread, round, job, output) not bitwise serial: {mismatches[:10]}"
    assert len(jobs_done) == THREADS * ROUNDS * 3
    print(f"{len(jobs_done)} jobs, {sum(jobs_done)} outputs, bitwise the serial results")


def test_the_backward_is_bitwise_the_same_from_any_thread():
    # Each call allocates its scratch afresh, at addresses that differ from
    # call to call and thread to thread, and the pool spreads the three (batch
    # row, value head) problems over its workers. The compiler's loop versions
    # once rounded differently (fused or not) by the buffers' addresses: the
    # chunked backward's gate gradients then changed in the last bits from
    # one call to the next (a tiny key dim and one token showed it best).
    for state_scale in ("unit", "huge"):
        case = make_core_case(
            0,
            batch=3,
            tokens=1,
            key_heads=1,
            value_heads=3,
            key_dim=3,
            value_dim=3,
            decay="none",
            beta_max=1.0,
            with_state=True,
            normalize_qk=True,
            state_scale=state_scale,
        )
        y_cotangent, state_cotangent = cotangents(case)
        for algorithm in ALGORITHMS:
            results = []

            def call():
                gradients, _ = run_core_backward_guarded(
                    *case.args(),
                    y_cotangent,
                    state_cotangent,
                    **case.options,
                    algorithm=algorithm,
                )
                results.append(gradients)

            for _ in range(40):
                thread = threading.Thread(target=call)
                thread.start()
                thread.join(timeout=120)
            assert len(results) == 40, "a backward call failed or hung"
            for name, first in results[0].items():
                differing = sum(
                    not np.array_equal(r[name], first, equal_nan=True) for r in results[1:]
                )
                assert differing == 0, (state_scale, algorithm, name, differing)


def test_the_stress_check_sees_a_wrong_result():
    # Probe: the comparison the stress relies on flags a one-ulp change.
    a = evaluated(workloads(0)[2](mx.default_stream(mx.default_device())))[0]
    b = a.copy()
    b.flat[np.argmax(np.abs(b))] = np.nextafter(b.flat[np.argmax(np.abs(b))], np.inf)
    assert not np.array_equal(a, b, equal_nan=True)


def parallel_for_errors(count, task_sleep_us=0):
    """What is wrong with one parallel_for(count): indices that did not run
    exactly once, or calls outside [0, count). Empty when it is right."""
    calls, strays = _ext.run_cpu_parallel_for(count, task_sleep_us)
    errors = [f"index {i} ran {n} times" for i, n in enumerate(calls) if n != 1]
    if len(calls) != count:
        errors.append(f"{len(calls)} counters for {count} indices")
    if strays:
        errors.append(f"{strays} calls outside [0, {count})")
    return errors


def test_parallel_for_runs_each_index_exactly_once():
    for count in POOL_COUNTS:
        errors = parallel_for_errors(count)
        assert not errors, (count, errors)


@pytest.mark.skipif(thread_count() < 2, reason="the pool has no worker to stall")
def test_after_a_worker_stalls_small_jobs_run_on_the_caller_alone():
    # A worker the OS preempts inside a task holds the caller up for the rest
    # of a time slice; after that, small jobs (a decode step's) do not wait
    # for workers, even when a woken worker would have joined in time.
    worker_joined, threads = _ext.cpu_pool_threads_after_stall(64)
    assert worker_joined, "no worker joined a job in 50 tries"
    assert threads == 1, f"a small job ran on {threads} threads right after a stall"


STALL_ON_A_POOL = "from mlx_gated_delta import _ext; print(*_ext.cpu_pool_threads_after_stall(64))"


def test_after_a_worker_stalls_small_jobs_run_on_the_caller_alone_on_a_large_pool():
    # A pool of more than two threads takes a stall only past 1 ms; a worker held up for
    # 50 ms is still one.
    result = run_python(STALL_ON_A_POOL, {"MLX_GATED_DELTA_NUM_THREADS": "4"})
    assert result.stdout.split() == ["True", "1"], result.stdout


def test_parallel_for_from_several_threads_at_once_runs_each_index_exactly_once():
    # MLX runs each stream's CPU work on a thread of its own, so the pool has
    # concurrent callers; the binding releases the GIL while the pool runs.
    failures, errors = [], []
    start = threading.Barrier(POOL_CALLERS)

    def caller(index):
        try:
            start.wait()
            for round_ in range(10 * ROUNDS):
                for count in POOL_COUNTS:
                    wrong = parallel_for_errors(count, POOL_TASK_SLEEP_US)
                    if wrong:
                        failures.append((index, round_, count, wrong))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append((index, repr(error)))

    # A pool that deadlocks fails here within two minutes, though the process
    # then cannot exit: its callers never return.
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(POOL_CALLERS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread hung in parallel_for"
    assert not errors, errors
    assert not failures, f"(thread, round, count, errors): {failures[:10]}"


# ---------------------------------------------------------------------------------------
# How many threads: the affinity mask, the cgroup quota, MLX_GATED_DELTA_NUM_THREADS.
# Each case runs in a fresh interpreter: the pool is sized once, when it starts.
# ---------------------------------------------------------------------------------------


def run_python(code, env=None, preexec_fn=None):
    """stdout of ``code`` in a fresh interpreter (failing the test when it fails)."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec_fn,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result


THREAD_COUNT = "import mlx_gated_delta; print(mlx_gated_delta.thread_count())"


def without_thread_count_setting():
    return {k: v for k, v in os.environ.items() if k != "MLX_GATED_DELTA_NUM_THREADS"}


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000\n", None),
        ("200000 100000\n", 2),
        ("150000 100000\n", 2),  # 1.5 CPUs: two threads, each part of the time
        ("50000 100000\n", 1),
        ("100000 100000", 1),
        ("6400000 100000\n", 64),
        ("200000\n", None),
        ("200000 100000 7\n", None),
        ("max\n", None),
        ("", None),
        ("2e5 100000\n", None),
        ("200000 0\n", None),
    ],
)
def test_cgroup_cpu_max_file_gives_the_quota_in_cpus(tmp_path, text, cpus):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    assert _ext.cpus_of_cgroup_cpu_max(cpu_max.read_text()) == cpus


@pytest.mark.parametrize(
    ("quota", "period", "cpus"),
    [("-1\n", "100000\n", None), ("400000\n", "100000\n", 4), ("30000\n", "100000\n", 1)],
)
def test_cgroup_v1_cfs_quota_gives_the_quota_in_cpus(quota, period, cpus):
    assert _ext.cpus_of_cfs_quota(quota, period) == cpus


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity masks here")
def test_a_one_cpu_affinity_mask_gives_one_thread():
    one_cpu = min(os.sched_getaffinity(0))

    def pin():
        os.sched_setaffinity(0, {one_cpu})

    env = without_thread_count_setting()
    result = subprocess.run(
        [sys.executable, "-c", THREAD_COUNT],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=pin,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]
    unpinned = subprocess.run(
        [sys.executable, "-c", THREAD_COUNT], capture_output=True, text=True, env=env, timeout=600
    )
    budget = _ext.cpu_thread_budget()
    usable = min(budget["affinity_cpus"], budget["quota_cpus"] or budget["affinity_cpus"])
    assert unpinned.stdout.split() == [str(usable)], unpinned.stderr


def test_the_environment_variable_sets_the_thread_count():
    assert run_python(THREAD_COUNT, {"MLX_GATED_DELTA_NUM_THREADS": "5"}).stdout.split() == ["5"]
    ignored = run_python(THREAD_COUNT, {"MLX_GATED_DELTA_NUM_THREADS": "zero"})
    default = run_python(THREAD_COUNT, {"MLX_GATED_DELTA_NUM_THREADS": ""})
    assert ignored.stdout == default.stdout
    assert "ignoring MLX_GATED_DELTA_NUM_THREADS=zero" in ignored.stderr


# How many threads a job of some multiply-adds asks for, on pools of 2 and 16 threads.
THREADS_FOR_WORK = (
    "from mlx_gated_delta import _ext; "
    "print(*(_ext.cpu_pool_threads_for_work(w) for w in (0, 262144, 524288, 2097152, 1 << 30)))"
)


def test_a_job_takes_a_thread_per_512k_multiply_adds_or_per_64k_on_a_large_pool():
    # On two threads the demo model's decode step (262K multiply-adds) stays on the caller and
    # Qwen3-Next's (2M) takes both; on more than two, a worker per 64K, so Qwen3-Next's step
    # takes 16 threads of 16 (docs/cpu.md, "How a call is shared").
    two = run_python(THREADS_FOR_WORK, {"MLX_GATED_DELTA_NUM_THREADS": "2"})
    assert two.stdout.split() == ["1", "1", "1", "2", "2"]
    four = run_python(THREADS_FOR_WORK, {"MLX_GATED_DELTA_NUM_THREADS": "4"})
    assert four.stdout.split() == ["1", "4", "4", "4", "4"]
    sixteen = run_python(THREADS_FOR_WORK, {"MLX_GATED_DELTA_NUM_THREADS": "16"})
    assert sixteen.stdout.split() == ["1", "4", "8", "16", "16"]


# Prints a digest of every output of the calls below: prefill (both algorithms), decode, the
# fused segment and the gradients, at sizes whose work spreads over every thread asked for.
OUTPUT_DIGEST = """
import hashlib
import mlx.core as mx
import numpy as np
import mlx_gated_delta
from mlx_gated_delta import gated_delta_rule, gated_delta_segment
from mlx_gated_delta.testing.segment_cases import make_segment_case
from mlx_gated_delta.testing.strategies import make_core_case

case = make_core_case(7, batch=2, tokens=150, key_heads=2, value_heads=4, key_dim=64,
                      value_dim=32, decay="mixed", wipes="runs", mask_kind="random")
segment = make_segment_case(8, batch=3, tokens=130, key_heads=2, value_heads=4, key_dim=32,
                            value_dim=32, wipes="chunk_edges", mask_kind="left_padding")
outputs = []
for algorithm in ("recurrent", "chunked"):
    outputs += gated_delta_rule(*case.args(), algorithm=algorithm, **case.options)
step = [x[:, :1] for x in case.args()[:5]]
outputs += gated_delta_rule(*step, case.state, **{**case.options, "mask": None})
outputs += gated_delta_segment(*segment.args(), **segment.options)
per_key = make_core_case(9, batch=2, tokens=150, key_heads=2, value_heads=4, key_dim=64,
                         value_dim=32, decay="mixed", wipes="runs", mask_kind="random",
                         per_key_gates=True)
outputs += gated_delta_rule(*per_key.args(), algorithm="chunked", **per_key.options)
for c in (case, per_key):
    for algorithm in ("recurrent", "chunked"):
        def loss(*args, algorithm=algorithm, options=c.options):
            y, state = gated_delta_rule(*args, algorithm=algorithm, **options)
            return (y * y).sum() + (state * state).sum()
        outputs += mx.grad(loss, argnums=tuple(range(6)))(*c.args())
mx.eval(outputs)
digest = hashlib.sha256()
for out in outputs:
    digest.update(np.array(out.astype(mx.float32)).tobytes())
print(mlx_gated_delta.thread_count(), digest.hexdigest())
"""


def test_results_are_bitwise_the_same_on_any_thread_count():
    digests = {}
    for threads in (1, 2, 3, 7):
        result = run_python(OUTPUT_DIGEST, {"MLX_GATED_DELTA_NUM_THREADS": str(threads)})
        count, digest = result.stdout.split()
        assert int(count) == threads
        digests[threads] = digest
    assert len(set(digests.values())) == 1, digests
