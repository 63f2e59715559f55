// Small kernels that exist only to test the emulator itself: each breaks one
// rule of the Metal execution model on purpose (tests/metal/test_emulator.py).
// Not part of the Metal library.

#include <metal_stdlib>

using namespace metal;

// Correct: a threadgroup reversal through threadgroup memory.
[[kernel]] void probe_reverse(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]]) {
  threadgroup float staged[1024];
  staged[tid] = data[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[tid] = staged[threads - 1 - tid];
}

// Divergent barriers: odd threads wait at another line than even ones.
[[kernel]] void probe_divergent_barrier(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  data[tid] = 1.0f;
}

// A barrier that thread 0 skips by returning early.
[[kernel]] void probe_early_return(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) {
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[tid] = 1.0f;
}

// A SIMD-group sum reached by only half of the lanes.
[[kernel]] void probe_divergent_simd_sum(
    device float* data [[buffer(0)]],
    uint lane [[thread_index_in_simdgroup]]) {
  float value = 1.0f;
  if (lane < 16) {
    value = simd_sum(value);
  }
  data[lane] = value;
}

// Uses 40 KiB of threadgroup memory, over Metal's 32 KiB.
[[kernel]] void probe_oversized_threadgroup_memory(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[10240];
  big[tid] = data[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[tid] = big[tid];
}

// Reads threadgroup memory that no thread of this threadgroup wrote.
[[kernel]] void probe_reads_unwritten_threadgroup_memory(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float staged[64];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[tid] = staged[tid];
}

// simd_sum and simd_shuffle among the lanes.
[[kernel]] void probe_simd_collectives(
    device float* data [[buffer(0)]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd_index [[simdgroup_index_in_threadgroup]]) {
  const uint at = simd_index * 32 + lane;
  float value = data[at];
  float total = simd_sum(value);
  float neighbour = simd_shuffle(value, ushort((lane + 1) % 32));
  data[at] = total * 1000.0f + neighbour;
}

// Writes one element past the end of a buffer of one float per thread.
[[kernel]] void probe_write_past_end(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]],
    uint threads [[threads_per_threadgroup]]) {
  data[tid + 1] = float(threads);
}

// Lanes 0-15 of SIMD-group 0 wait at a threadgroup barrier that lanes 16-31
// never reach, while those wait in a SIMD sum that lanes 0-15 never join:
// neither side can finish (a deadlock, found by the barrier timeout).
[[kernel]] void probe_deadlock(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  float value = 1.0f;
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    value = simd_sum(value);
  }
  data[tid] = value;
}

// data[128..192) = A B + C for the 8 x 8 matrices A = data[0..64),
// B = data[64..128) (read transposed when data[192] != 0), C = 1.
[[kernel]] void probe_simdgroup_matrix(
    device float* data [[buffer(0)]]) {
  simdgroup_matrix<float, 8, 8> a;
  simdgroup_matrix<float, 8, 8> b;
  simdgroup_load(a, data, 8);
  if (data[192] != 0.0f) {
    simdgroup_load(b, data + 64, 8, ulong2(0, 0), true);
  } else {
    simdgroup_load(b, data + 64, 8);
  }
  simdgroup_matrix<float, 8, 8> c = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_multiply_accumulate(c, a, b, c);
  simdgroup_store(c, data + 128, 8);
}

// Lanes load from lane-dependent places: the matrices differ across lanes.
[[kernel]] void probe_simdgroup_matrix_divergent_load(
    device float* data [[buffer(0)]],
    uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_matrix<float, 8, 8> a;
  simdgroup_load(a, data + lane, 8);
  simdgroup_store(a, data + 128, 8);
}

// SIMD-group 1 shuffles from a lane that does not exist while SIMD-group 0
// waits at a barrier: the error must end the dispatch at once.
[[kernel]] void probe_error_while_others_wait(
    device float* data [[buffer(0)]],
    uint tid [[thread_index_in_threadgroup]]) {
  if (tid >= 32) {
    data[0] = simd_shuffle(1.0f, ushort(40));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
