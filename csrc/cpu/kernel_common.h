// Helpers shared by the recurrent and the chunked CPU kernels: the addresses
// of one (batch row, value head) problem and the float32 vector primitives.
// Like every kernel header, it declares into the namespace of the level the
// source is compiled for (kernel_level.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/forward.h"
#include "cpu/kernel_entry_points.h"
#include "cpu/multiply_add.h"
#include "mlx/types/half_types.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// The sum of a[i] * b[i] in an order fixed by n alone: element i goes into
// partial sum i % kDotLanes, and the partial sums are added in a fixed tree.
// The compiler vectorises the lanes without reassociating anything. An
// `omp simd` reduction leaves the order to the compiler, whose loop versions
// (peeled for alignment, or scalar when two buffers lie close together)
// summed differently: results then depended on where the scratch happened to
// be allocated, that is on the thread that ran the problem.
constexpr int kDotLanes = 16;

// The partial sums of `dot` added in its fixed tree: lane l + w into lane l,
// for w = 8, 4, 2, 1. Written out step by step, so that each step is a whole
// vector operation in registers (a loop over the widths left the lanes on
// the stack, one store and reload per step). Float64 lanes too
// (qk_grad_reduce's sums).
template <typename F>
inline F sum_lanes(F* lanes) {
  static_assert(kDotLanes == 16);
  for (int l = 0; l < 8; ++l) {
    lanes[l] += lanes[l + 8];
  }
  for (int l = 0; l < 4; ++l) {
    lanes[l] += lanes[l + 4];
  }
  for (int l = 0; l < 2; ++l) {
    lanes[l] += lanes[l + 2];
  }
  return lanes[0] + lanes[1];
}

// lanes[l] += a[l] b[l], one multiply-add for each of the kDotLanes lanes.
inline void multiply_add_lanes(const float* a, const float* b, float* lanes) {
  for (int l = 0; l < kDotLanes; ++l) {
    lanes[l] = multiply_add(a[l], b[l], lanes[l]);
  }
}

// out[r] = sum_i a[r * lda + i] b[i] for Rows rows of a, each row summed in
// kDotLanes lanes and then sum_lanes' tree: an order that is fixed, so a
// row's sum does not depend on how many rows come with it. The rows' chains
// are independent, so the core overlaps them, and their loads are in flight
// together, where one row's sum waits on each multiply-add before the next.
// The rows of a step are spelled out (a pack over R), not looped over: with a
// loop over the rows GCC kept the lanes in memory, a store and a reload per
// step of every row (a quarter of the decode projection's time); spelled out,
// they stay in registers.
template <int Rows>
inline void dots(
    const float* a, int64_t lda, const float* b, int n, float* out) {
  float lanes[Rows][kDotLanes] = {};
  const int whole = n - n % kDotLanes;
  for (int i = 0; i < whole; i += kDotLanes) {
    [&]<int... R>(std::integer_sequence<int, R...>) {
      (multiply_add_lanes(a + R * lda + i, b + i, lanes[R]), ...);
    }(std::make_integer_sequence<int, Rows>{});
  }
  for (int r = 0; r < Rows; ++r) {
    for (int i = whole; i < n; ++i) {
      lanes[r][i - whole] =
          multiply_add(a[r * lda + i], b[i], lanes[r][i - whole]);
    }
    out[r] = sum_lanes(lanes[r]);
  }
}

// One row of dots.
inline float dot(const float* a, const float* b, int n) {
  float out;
  dots<1>(a, 0, b, n, &out);
  return out;
}

// y += alpha * x
inline void axpy(float alpha, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    y[i] = multiply_add(alpha, x[i], y[i]);
  }
}

template <typename T>
inline void load_vector(const T* source, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    out[i] = static_cast<float>(source[i]);
  }
}

// Asks for `rows` rows of `row_elements` elements, `row_stride` elements
// apart, to be brought into the L2 cache. A head's rows of q, k, v and the
// gates lie a whole token apart (a page or more), so the hardware prefetchers,
// which follow a stream within a page, do not fetch the next row; a chunk's
// stage that loads them would wait on memory for each row.
template <typename T>
inline void prefetch_rows(
    const T* first, int rows, int64_t row_stride, int row_elements) {
  constexpr int kLine = 64;
  const int bytes = row_elements * static_cast<int>(sizeof(T));
  for (int i = 0; i < rows; ++i) {
    const char* row = reinterpret_cast<const char*>(first + i * row_stride);
    for (int b = 0; b < bytes; b += kLine) {
      __builtin_prefetch(row + b, 0, 2);
    }
    __builtin_prefetch(row + bytes - 1, 0, 2);
  }
}

// q and k are optionally L2-normalised per head, in float32 (docs/contract.md).
inline void normalize(float* x, int n) {
  const float inverse_norm = 1.0f / std::sqrt(dot(x, x, n) + 1e-6f);
  for (int i = 0; i < n; ++i) {
    x[i] *= inverse_norm;
  }
}

template <typename T>
inline void load_qk_vector(
    const T* source, float* out, int n, bool normalize_qk) {
  load_vector(source, out, n);
  if (normalize_qk) {
    normalize(out, n);
  }
}

// Addresses of one (batch row, value head) problem.
template <typename T>
struct HeadView {
  const T* q;  // token 0 of this problem's key head
  const T* k;
  const T* v;
  int64_t qk_token_stride;
  int64_t v_token_stride;
  const float* g;  // token 0 (and channel 0 with per-key gates)
  int64_t g_token_stride;  // value_heads * gate_width()
  const float* beta;
  const bool* mask;  // token 0 of the batch row, or nullptr
  int64_t gate_token_stride;  // of beta: value_heads
  T* y;  // token 0; token stride = value_heads * value_dim
  int64_t y_token_stride;
  const float* state_in;  // [Dv, Dk] initial state, or nullptr for zeros
  float* state;  // [Dv, Dk] final state
  // The state after checkpoints[n] tokens goes to
  // checkpoint_state + n * checkpoint_stride ([Dv, Dk]); none when count is 0.
  const int* checkpoints;
  int checkpoint_count;
  float* checkpoint_state;
  int64_t checkpoint_stride;
  const int* parents;  // [T], or nullptr for a sequence
};

template <typename T>
inline HeadView<T> head_view(
    const GatedDeltaParams& p, const CoreBuffers<T>& b, int batch, int head) {
  const int key_head = p.key_head_of(head);
  const int64_t gate_offset = int64_t(batch) * p.tokens * p.value_heads + head;
  return HeadView<T>{
      b.q + batch * b.qk_batch_stride + int64_t(key_head) * p.key_dim,
      b.k + batch * b.qk_batch_stride + int64_t(key_head) * p.key_dim,
      b.v + batch * b.v_batch_stride + int64_t(head) * p.value_dim,
      b.qk_token_stride,
      b.v_token_stride,
      b.g + gate_offset * p.gate_width(),
      int64_t(p.value_heads) * p.gate_width(),
      b.beta + gate_offset,
      b.mask ? b.mask + int64_t(batch) * p.tokens : nullptr,
      p.value_heads,
      b.y + (int64_t(batch) * p.tokens * p.value_heads + head) * p.value_dim,
      int64_t(p.value_heads) * p.value_dim,
      b.state_in ? b.state_in +
              (int64_t(batch) * p.value_heads + head) * p.value_dim * p.key_dim
                 : nullptr,
      b.state_out +
          (int64_t(batch) * p.value_heads + head) * p.value_dim * p.key_dim,
      b.checkpoints,
      b.checkpoint_states ? p.checkpoint_count : 0,
      b.checkpoint_states ? b.checkpoint_states +
              (int64_t(batch) * p.value_heads + head) * p.value_dim * p.key_dim
                          : nullptr,
      int64_t(p.batch) * p.value_heads * p.value_dim * p.key_dim,
      b.parents,
  };
}

template <typename T>
inline void zero_output_row(T* y, int n) {
  for (int i = 0; i < n; ++i) {
    y[i] = T(0.0f);
  }
}

// Copies a [Dv, Dk] state (or zeros, for nullptr): the initial state into
// the final-state buffer of the paths that update it in place, a state into
// a checkpoint slot.
inline void copy_state(
    const GatedDeltaParams& p, const float* state_in, float* state) {
  const size_t bytes = sizeof(float) * p.value_dim * p.key_dim;
  if (state_in) {
    std::memcpy(state, state_in, bytes);
  } else {
    std::memset(state, 0, bytes);
  }
}

// The [Dv, Dk] slot of checkpoint n.
template <typename T>
inline float* checkpoint_slot(const HeadView<T>& h, int n) {
  return h.checkpoint_state + n * h.checkpoint_stride;
}

// The two algorithms, for one problem: read state_in, write the final state.
template <typename T>
void recurrent_head(const GatedDeltaParams& p, const HeadView<T>& h);
// The chunked form runs the value heads that read one key head together, so
// that their shared work (loading and normalising q and k, the grams K K^T and
// Q K^T) is done once; `heads` all read the same key head and batch row.
// A non-null `trace` (testing only; one head) records every stage's output.
template <typename T>
void chunked_heads(
    const GatedDeltaParams& p,
    const HeadView<T>* heads,
    int head_count,
    ChunkedTrace* trace = nullptr);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
