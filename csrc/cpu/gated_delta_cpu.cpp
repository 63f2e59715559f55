// CPU kernels of the core gated-delta recurrence: the token-by-token
// recurrent form and the chunked WY/UT form (chunks of kChunkSize tokens).
//
// Each (batch row, value head) pair is an independent problem; they are spread
// over the thread pool. All arithmetic is float32 whatever the activation
// dtype; activations are converted once when a token's vectors are loaded.
#include "cpu/gated_delta_cpu.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/thread_pool.h"
#include "mlx/types/half_types.h"

namespace mlx_gated_delta::cpu {

namespace {

using mlx::core::bfloat16_t;
using mlx::core::float16_t;

float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) {
    sum += a[i] * b[i];
  }
  return sum;
}

// y += alpha * x
void axpy(float alpha, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    y[i] += alpha * x[i];
  }
}

template <typename T>
void load_vector(const T* source, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    out[i] = static_cast<float>(source[i]);
  }
}

// q and k are optionally L2-normalised per head, in float32 (API.md).
template <typename T>
void load_qk_vector(const T* source, float* out, int n, bool normalize) {
  load_vector(source, out, n);
  if (normalize) {
    const float inverse_norm = 1.0f / std::sqrt(dot(out, out, n) + 1e-6f);
    for (int i = 0; i < n; ++i) {
      out[i] *= inverse_norm;
    }
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
  const float* g;  // token 0; token stride = value_heads
  const float* beta;
  const bool* mask;  // token 0 of the batch row, or nullptr
  int64_t gate_token_stride;
  T* y;  // token 0; token stride = value_heads * value_dim
  int64_t y_token_stride;
  float* state;  // [Dv, Dk], holds the initial state on entry
};

template <typename T>
HeadView<T> head_view(
    const GatedDeltaParams& p,
    const CoreBuffers<T>& b,
    int batch,
    int head) {
  const int key_head = p.key_head_of(head);
  const int64_t gate_offset = int64_t(batch) * p.tokens * p.value_heads + head;
  return HeadView<T>{
      b.q + batch * b.qk_batch_stride + int64_t(key_head) * p.key_dim,
      b.k + batch * b.qk_batch_stride + int64_t(key_head) * p.key_dim,
      b.v + batch * b.v_batch_stride + int64_t(head) * p.value_dim,
      b.qk_token_stride,
      b.v_token_stride,
      b.g + gate_offset,
      b.beta + gate_offset,
      b.mask ? b.mask + int64_t(batch) * p.tokens : nullptr,
      p.value_heads,
      b.y + (int64_t(batch) * p.tokens * p.value_heads + head) * p.value_dim,
      int64_t(p.value_heads) * p.value_dim,
      b.state_out +
          (int64_t(batch) * p.value_heads + head) * p.value_dim * p.key_dim,
  };
}

template <typename T>
void zero_output_row(T* y, int n) {
  for (int i = 0; i < n; ++i) {
    y[i] = T(0.0f);
  }
}

// ---------------------------------------------------------------------------
// Recurrent form: one pass over the state per token. For each state row r the
// decay, the prediction S k, the delta update and the readout S q are fused,
// so the row is read and written once while it sits in L1.
template <typename T>
void recurrent_head(const GatedDeltaParams& p, const HeadView<T>& h) {
  const int dk = p.key_dim, dv = p.value_dim;
  std::vector<float> q(dk), k(dk), v(dv);
  for (int t = 0; t < p.tokens; ++t) {
    T* y = h.y + t * h.y_token_stride;
    if (h.mask && !h.mask[t]) {
      zero_output_row(y, dv);
      continue;
    }
    load_qk_vector(h.q + t * h.qk_token_stride, q.data(), dk, p.normalize_qk);
    load_qk_vector(h.k + t * h.qk_token_stride, k.data(), dk, p.normalize_qk);
    load_vector(h.v + t * h.v_token_stride, v.data(), dv);
    const float decay = std::exp(h.g[t * h.gate_token_stride]);
    const float beta = h.beta[t * h.gate_token_stride];
    for (int r = 0; r < dv; ++r) {
      float* row = h.state + int64_t(r) * dk;
      const float predicted = decay * dot(row, k.data(), dk);
      const float delta = beta * (v[r] - predicted);
      float readout = 0.0f;
#pragma omp simd reduction(+ : readout)
      for (int c = 0; c < dk; ++c) {
        const float updated = decay * row[c] + delta * k[c];
        row[c] = updated;
        readout += updated * q[c];
      }
      y[r] = T(p.scale * readout);
    }
  }
}

// ---------------------------------------------------------------------------
// Chunked WY/UT form. Per chunk of L tokens with entry state S0 ([Dv, Dk]):
//   decay(i, j) = prod_{j < s <= i} exp(g_s)          (j = -1: chunk start)
//   A_ij = beta_i decay(i, j) k_i.k_j   (j < i)        k_gram
//   (I + A) U = diag(beta) V,  (I + A) W = diag(beta decay(i,-1)) K
//                                                      solve_tril / recompute_w_u
//   V' = U - W S0^T                                    (the true deltas d_i)
//   y_i = scale (decay(i,-1) S0 q_i + sum_{j<=i} decay(i,j) q_i.k_j V'_j)
//                                                      chunk_output
//   S_end = decay(L-1,-1) S0 + sum_j decay(L-1, j) V'_j k_j^T     chunk_state
// A decay that underflows to exactly 0 (g = -inf from gamma == 0) is a wipe:
// decay(i, j) is 0 whenever a wipe lies in (j, i], decided by index, never by
// subtracting cumulative logs across it (that would be -inf - -inf = NaN).
class ChunkDecays {
 public:
  void compute(const float* g, const bool* active, int length) {
    length_ = length;
    for (int i = 0; i < length; ++i) {
      const float gi = active[i] ? g[i] : 0.0f;
      const bool wipe = std::exp(gi) == 0.0f;
      const float previous_sum = i ? log_sum_[i - 1] : 0.0f;
      log_sum_[i] = previous_sum + (wipe ? 0.0f : gi);
      last_wipe_[i] = wipe ? i : (i ? last_wipe_[i - 1] : -1);
    }
  }
  // decay(i, j) for -1 <= j <= i.
  float operator()(int i, int j) const {
    if (last_wipe_[i] > j) {
      return 0.0f;
    }
    return std::exp(log_sum_[i] - (j >= 0 ? log_sum_[j] : 0.0f));
  }
  float from_start(int i) const {
    return (*this)(i, -1);
  }
  float to_end(int j) const {
    return (*this)(length_ - 1, j);
  }

 private:
  int length_ = 0;
  float log_sum_[kChunkSize];
  int last_wipe_[kChunkSize];
};

// Scratch for one chunk, reused across chunks and problems of one task.
struct ChunkScratch {
  ChunkScratch(int dk, int dv)
      : q(kChunkSize * dk),
        k(kChunkSize * dk),
        w(kChunkSize * dk),
        u(kChunkSize * dv),
        y(kChunkSize * dv),
        a(kChunkSize * kChunkSize) {}
  std::vector<float> q, k, w;  // [L, Dk]
  std::vector<float> u, y;     // [L, Dv]; u becomes V' in place
  std::vector<float> a;        // [L, L], strictly lower part used
  float beta[kChunkSize];
  float g[kChunkSize];
  bool active[kChunkSize];
  ChunkDecays decays;
};

template <typename T>
void chunked_head(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    ChunkScratch& s) {
  const int dk = p.key_dim, dv = p.value_dim;
  float* state = h.state;
  for (int start = 0; start < p.tokens; start += kChunkSize) {
    const int length = std::min(kChunkSize, p.tokens - start);

    // Load the chunk. A masked token is a step that changes nothing: decay 1
    // and beta 0 make its delta vanish; its output row is written as 0.
    for (int i = 0; i < length; ++i) {
      const int t = start + i;
      s.active[i] = !h.mask || h.mask[t];
      s.g[i] = h.g[t * h.gate_token_stride];
      s.beta[i] = s.active[i] ? h.beta[t * h.gate_token_stride] : 0.0f;
      load_qk_vector(
          h.q + t * h.qk_token_stride, &s.q[i * dk], dk, p.normalize_qk);
      load_qk_vector(
          h.k + t * h.qk_token_stride, &s.k[i * dk], dk, p.normalize_qk);
      load_vector(h.v + t * h.v_token_stride, &s.u[i * dv], dv);
    }
    s.decays.compute(s.g, s.active, length);
    const ChunkDecays& decay = s.decays;

    // k_gram: A_ij = beta_i decay(i, j) k_i.k_j for j < i.
    for (int i = 0; i < length; ++i) {
      for (int j = 0; j < i; ++j) {
        s.a[i * kChunkSize + j] =
            s.beta[i] * decay(i, j) * dot(&s.k[i * dk], &s.k[j * dk], dk);
      }
    }

    // solve_tril + recompute_w_u by forward substitution:
    //   U_i = beta_i v_i - sum_{j<i} A_ij U_j
    //   W_i = beta_i decay(i,-1) k_i - sum_{j<i} A_ij W_j
    for (int i = 0; i < length; ++i) {
      float* u_i = &s.u[i * dv];
      float* w_i = &s.w[i * dk];
      const float w_scale = s.beta[i] * decay.from_start(i);
      for (int c = 0; c < dv; ++c) {
        u_i[c] *= s.beta[i];
      }
      for (int c = 0; c < dk; ++c) {
        w_i[c] = w_scale * s.k[i * dk + c];
      }
      for (int j = 0; j < i; ++j) {
        const float a_ij = s.a[i * kChunkSize + j];
        axpy(-a_ij, &s.u[j * dv], u_i, dv);
        axpy(-a_ij, &s.w[j * dk], w_i, dk);
      }
    }

    // Reads of the entry state: V' = U - W S0^T and the inter-chunk part of
    // the output, decay(i,-1) S0 q_i, one state row at a time.
    for (int r = 0; r < dv; ++r) {
      const float* row = state + int64_t(r) * dk;
      for (int i = 0; i < length; ++i) {
        s.u[i * dv + r] -= dot(row, &s.w[i * dk], dk);
        s.y[i * dv + r] = decay.from_start(i) * dot(row, &s.q[i * dk], dk);
      }
    }

    // chunk_output, intra-chunk part: y_i += sum_{j<=i} decay(i,j) q_i.k_j V'_j
    for (int i = 0; i < length; ++i) {
      float* y_i = &s.y[i * dv];
      for (int j = 0; j <= i; ++j) {
        const float weight = decay(i, j) * dot(&s.q[i * dk], &s.k[j * dk], dk);
        axpy(weight, &s.u[j * dv], y_i, dv);
      }
      T* y = h.y + (start + i) * h.y_token_stride;
      if (!s.active[i]) {
        zero_output_row(y, dv);
        continue;
      }
      for (int c = 0; c < dv; ++c) {
        y[c] = T(p.scale * y_i[c]);
      }
    }

    // chunk_state: S_end = decay(L-1,-1) S0 + sum_j decay(L-1,j) V'_j k_j^T
    const float chunk_decay = decay.from_start(length - 1);
    for (int j = 0; j < length; ++j) {
      s.w[j] = decay.to_end(j);  // W is no longer needed: reuse as weights
    }
    for (int r = 0; r < dv; ++r) {
      float* row = state + int64_t(r) * dk;
      for (int c = 0; c < dk; ++c) {
        row[c] *= chunk_decay;
      }
      for (int j = 0; j < length; ++j) {
        axpy(s.w[j] * s.u[j * dv + r], &s.k[j * dk], row, dk);
      }
    }
  }
}

}  // namespace

template <typename T>
void gated_delta_forward(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const CoreBuffers<T>& buffers) {
  const int problems = p.batch * p.value_heads;
  const int64_t state_size = int64_t(p.value_dim) * p.key_dim;
  parallel_for(problems, [&](int problem) {
    const int batch = problem / p.value_heads;
    const int head = problem % p.value_heads;
    const HeadView<T> view = head_view(p, buffers, batch, head);
    if (buffers.state_in) {
      std::memcpy(
          view.state,
          buffers.state_in + int64_t(problem) * state_size,
          state_size * sizeof(float));
    } else {
      std::memset(view.state, 0, state_size * sizeof(float));
    }
    if (algorithm == Algorithm::Chunked) {
      ChunkScratch scratch(p.key_dim, p.value_dim);
      chunked_head(p, view, scratch);
    } else {
      recurrent_head(p, view);
    }
  });
}

template void gated_delta_forward<float>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<float>&);
template void gated_delta_forward<float16_t>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<float16_t>&);
template void gated_delta_forward<bfloat16_t>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu
