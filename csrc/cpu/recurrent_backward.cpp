// The backward pass of the gated delta rule on the CPU in the recurrent form
// (algorithm "recurrent", short calls), with O(T / 64)
// states in memory; chunked_backward.cpp has the chunked WY form. Both end
// in qk_grad_reduce, here.
//
// Per active token the forward is (a = exp(g), S is [Dv, Dk]):
//   Sd = a S_prev;  p = Sd k;  d = beta (v - p);  S = Sd + d k^T;
//   y = scale S q.
// Its reverse, given dy and dS (the cotangent of S after the token):
//   dS += scale dy q^T;        dq = scale S^T dy;
//   dd = dS k;                 dk = dS^T d + Sd^T dp;   dp = -beta dd;
//   dv = beta dd;              dbeta = dd . (v - p);
//   dSd = dS + dp k^T;         da = <dSd, S_prev>;      dg = a da;
//   dS_prev = a dSd.
// dg = a da is exactly 0 at a wipe (a = 0, g = -inf) and da, the gradient of
// the linear decay (gated_delta_update's gamma), stays finite there.
// Per-key gates (a decay a_c per state column c): Sd = S_prev diag(a), and
// column by column dk_c gains a_c dp S_prev[:, c], da_c = <dSd[:, c],
// S_prev[:, c]>, dS_prev[:, c] = a_c dSd[:, c].
//
// The reverse needs the state before and after every token. Keeping them all
// would be T states per head (16 GiB for the Qwen3-Next shape at T = 8192),
// so each (batch row, value head) problem runs in three stages:
//   boundary_states:  the forward once more, keeping only the state entering
//                     each chunk of 64 tokens (T / 64 states);
//   chunk_states:     per chunk, last to first: the 64 states inside it,
//                     recomputed from the chunk's boundary state;
//   recurrent_chunk_backward: the tokens of that chunk in reverse, carrying dS.
// Then qk_grad_reduce sums the per-value-head gradients of q and k over the
// value heads that read each key head and takes them through the L2 norm.
//
// Recomputing the boundaries here rather than saving them in the forward keeps
// the forward primitive, its kernels and its outputs unchanged (an inference
// call pays nothing for training), at the price of one more forward pass,
// a fraction of the backward's work.
#include "cpu/backward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu/backward_head_view.h"
#include "cpu/kernel_common.h"
#include "cpu/thread_pool.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

namespace {

// The vectors of one token, in float32, q and k normalised as the forward
// normalises them.
// With per-key gates `decays` holds the decay of each state column and
// `decay` is unused; otherwise `decays` is empty.
struct TokenInputs {
  std::vector<float> q, k, v, dy, decays;
  float decay = 0.0f, beta = 0.0f;
  bool active = false;
  TokenInputs(int dk, int dv, bool per_key)
      : q(dk), k(dk), v(dv), dy(dv), decays(per_key ? dk : 0) {}
  // The decay of state column c.
  float column_decay(int c) const {
    return decays.empty() ? decay : decays[c];
  }
};

template <typename T>
void load_token(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int t,
    bool with_readout,
    TokenInputs& x) {
  x.active = !h.mask || h.mask[t];
  if (!x.active) {
    return;
  }
  load_qk_vector(
      h.k + t * h.qk_token_stride, x.k.data(), p.key_dim, p.normalize_qk);
  load_vector(h.v + t * h.v_token_stride, x.v.data(), p.value_dim);
  const float* g = h.g + t * h.g_token_stride;
  if (p.per_key_gates) {
    for (int c = 0; c < p.key_dim; ++c) {
      x.decays[c] = std::exp(g[c]);
    }
  } else {
    x.decay = std::exp(g[0]);
  }
  x.beta = h.beta[t * h.gate_token_stride];
  if (with_readout) {
    load_qk_vector(
        h.q + t * h.qk_token_stride, x.q.data(), p.key_dim, p.normalize_qk);
    load_vector(h.dy + t * h.v_token_stride, x.dy.data(), p.value_dim);
  }
}

// One token of the forward, from `previous` into `next` (may be the same).
void forward_step(
    const GatedDeltaParams& p,
    const TokenInputs& x,
    const float* previous,
    float* next) {
  const int dk = p.key_dim;
  for (int r = 0; r < p.value_dim; ++r) {
    const float* old_row = previous + int64_t(r) * dk;
    float* row = next + int64_t(r) * dk;
    if (p.per_key_gates) {
      float predicted = 0.0f;
      for (int c = 0; c < dk; ++c) {
        predicted += x.decays[c] * old_row[c] * x.k[c];
      }
      const float delta = x.beta * (x.v[r] - predicted);
      for (int c = 0; c < dk; ++c) {
        row[c] = x.decays[c] * old_row[c] + delta * x.k[c];
      }
      continue;
    }
    const float predicted = x.decay * dot(old_row, x.k.data(), dk);
    const float delta = x.beta * (x.v[r] - predicted);
#pragma omp simd
    for (int c = 0; c < dk; ++c) {
      row[c] = x.decay * old_row[c] + delta * x.k[c];
    }
  }
}

// boundary_states: boundaries[c] = the state entering chunk c.
template <typename T>
void boundary_states(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    TokenInputs& x,
    float* boundaries) {
  const int64_t size = int64_t(p.value_dim) * p.key_dim;
  std::vector<float> state(h.state_in, h.state_in + size);
  for (int c = 0; c < p.num_chunks(); ++c) {
    std::memcpy(boundaries + c * size, state.data(), sizeof(float) * size);
    const int end = std::min(p.tokens, (c + 1) * int(kChunkSize));
    for (int t = c * kChunkSize; t < end; ++t) {
      load_token(p, h, t, false, x);
      if (x.active) {
        forward_step(p, x, state.data(), state.data());
      }
    }
  }
}

// chunk_states: states[i] = the state before token start + i, for i in
// [0, length]; states[0] is the chunk's boundary state.
template <typename T>
void chunk_states(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int length,
    TokenInputs& x,
    float* states) {
  const int64_t size = int64_t(p.value_dim) * p.key_dim;
  for (int i = 0; i < length; ++i) {
    load_token(p, h, start + i, false, x);
    if (x.active) {
      forward_step(p, x, states + i * size, states + (i + 1) * size);
    } else {
      std::memcpy(
          states + (i + 1) * size, states + i * size, sizeof(float) * size);
    }
  }
}

// recurrent_chunk_backward: the reverse of tokens [start, start + length), last
// first; `ds` holds the cotangent of the state after the chunk on entry and
// before it on return. The reverse of one token works row by row of the state,
// in two passes over the row (see the top of this file for the formulas).
template <typename T>
void recurrent_chunk_backward(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int length,
    TokenInputs& x,
    const float* states,
    float* ds) {
  const int dk = p.key_dim, dv = p.value_dim;
  const int64_t size = int64_t(dv) * dk;
  std::vector<float> dq(dk), dk_acc(dk);
  // Per-key gates: the gradient of each column's decay, summed over the rows.
  std::vector<float> dgammas(p.per_key_gates ? dk : 0);
  for (int i = length - 1; i >= 0; --i) {
    const int t = start + i;
    float* dq_out = h.dq_head + t * h.head_grad_token_stride;
    float* dk_out = h.dk_head + t * h.head_grad_token_stride;
    T* dv_out = h.dv + t * h.v_token_stride;
    const int64_t gate = t * h.gate_token_stride;
    float* dg_out = h.dg + t * h.g_token_stride;
    float* dgamma_out = h.dgamma + t * h.g_token_stride;
    const int gate_width = p.gate_width();
    load_token(p, h, t, true, x);
    if (!x.active) {  // a skipped token: dS passes through, no gradients
      std::fill(dq_out, dq_out + dk, 0.0f);
      std::fill(dk_out, dk_out + dk, 0.0f);
      zero_output_row(dv_out, dv);
      std::fill(dg_out, dg_out + gate_width, 0.0f);
      std::fill(dgamma_out, dgamma_out + gate_width, 0.0f);
      h.dbeta[gate] = 0.0f;
      continue;
    }
    const float* previous = states + i * size;
    const float* updated = states + (i + 1) * size;
    std::fill(dq.begin(), dq.end(), 0.0f);
    std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
    std::fill(dgammas.begin(), dgammas.end(), 0.0f);
    float dgamma = 0.0f, dbeta = 0.0f;
    for (int r = 0; r < dv; ++r) {
      const float* old_row = previous + int64_t(r) * dk;
      const float* new_row = updated + int64_t(r) * dk;
      float* ds_row = ds + int64_t(r) * dk;
      const float dy_scaled = p.scale * x.dy[r];
      // Pass 1: dS += scale dy q^T; dq += scale dy_r S_r; dd = dS k; S_prev k.
      float dd = 0.0f, old_k = 0.0f;
      if (p.per_key_gates) {
        // old_k is the prediction itself: sum_c a_c S_prev[r, c] k_c.
        for (int c = 0; c < dk; ++c) {
          const float ds_c = ds_row[c] + dy_scaled * x.q[c];
          ds_row[c] = ds_c;
          dq[c] += dy_scaled * new_row[c];
          dd += ds_c * x.k[c];
          old_k += x.decays[c] * old_row[c] * x.k[c];
        }
      } else {
        for (int c = 0; c < dk; ++c) {
          ds_row[c] += dy_scaled * x.q[c];
          dq[c] += dy_scaled * new_row[c];
        }
        dd = dot(ds_row, x.k.data(), dk);
        old_k = dot(old_row, x.k.data(), dk);
      }
      const float residual =
          x.v[r] - (p.per_key_gates ? old_k : x.decay * old_k);  // v - p
      const float delta = x.beta * residual;
      const float dp = -x.beta * dd;
      dv_out[r] = T(x.beta * dd);
      dbeta += dd * residual;
      // Pass 2: dk += d dS + a dp S_prev; dSd = dS + dp k; da; dS_prev.
      if (p.per_key_gates) {
        // Column c: dk_c += d dS_c + a_c dp S_prev_c; da_c += dSd_c S_prev_c;
        // dS_prev_c = a_c dSd_c.
        for (int c = 0; c < dk; ++c) {
          const float ds_c = ds_row[c];
          dk_acc[c] += delta * ds_c + x.decays[c] * dp * old_row[c];
          const float dsd = ds_c + dp * x.k[c];
          dgammas[c] += dsd * old_row[c];
          ds_row[c] = x.decays[c] * dsd;
        }
        continue;
      }
      const float decayed_dp = x.decay * dp;
      for (int c = 0; c < dk; ++c) {
        const float ds_c = ds_row[c];
        dk_acc[c] += delta * ds_c + decayed_dp * old_row[c];
        ds_row[c] = ds_c + dp * x.k[c];  // dSd, scaled by the decay below
      }
      dgamma += dot(ds_row, old_row, dk);
      for (int c = 0; c < dk; ++c) {
        ds_row[c] *= x.decay;
      }
    }
    std::copy(dq.begin(), dq.end(), dq_out);
    std::copy(dk_acc.begin(), dk_acc.end(), dk_out);
    if (p.per_key_gates) {
      for (int c = 0; c < dk; ++c) {
        dgamma_out[c] = dgammas[c];
        dg_out[c] = x.decays[c] * dgammas[c];  // exactly 0 at a channel's wipe
      }
    } else {
      dgamma_out[0] = dgamma;
      dg_out[0] = x.decay * dgamma;  // exactly 0 at a wipe
    }
    h.dbeta[gate] = dbeta;
  }
}

template <typename T>
void recurrent_head_backward(
    const GatedDeltaParams& p, const BackwardHeadView<T>& h) {
  const int64_t size = int64_t(p.value_dim) * p.key_dim;
  TokenInputs x(p.key_dim, p.value_dim, p.per_key_gates);
  std::vector<float> boundaries(p.num_chunks() * size);
  boundary_states(p, h, x, boundaries.data());

  std::vector<float> states((kChunkSize + 1) * size);
  std::copy(h.state_cotangent, h.state_cotangent + size, h.dstate);
  for (int c = p.num_chunks() - 1; c >= 0; --c) {
    const int start = c * kChunkSize;
    const int length = std::min(int(kChunkSize), p.tokens - start);
    std::copy(
        boundaries.begin() + c * size,
        boundaries.begin() + (c + 1) * size,
        states.begin());
    chunk_states(p, h, start, length, x, states.data());
    recurrent_chunk_backward(p, h, start, length, x, states.data(), h.dstate);
  }
}

}  // namespace

template <typename T>
void recurrent_chunk_backward_from_entry(
    const GatedDeltaParams& p,
    const BackwardHeadView<T>& h,
    int start,
    int length,
    const float* entry,
    float* ds) {
  const int64_t size = int64_t(p.value_dim) * p.key_dim;
  TokenInputs x(p.key_dim, p.value_dim, p.per_key_gates);
  std::vector<float> states((length + 1) * size);
  std::copy(entry, entry + size, states.begin());
  chunk_states(p, h, start, length, x, states.data());
  recurrent_chunk_backward(p, h, start, length, x, states.data(), ds);
}

namespace {

// qk_grad_reduce for one (batch row, token, key head): the gradient c of the
// normalised vector, summed over the value heads that read it (`head_grads`,
// the group's per-value-head rows of this token, `head_stride` apart, in the
// order of its heads), then through x / n, n = sqrt(x.x + eps):
// (c n^2 - x (x.c)) / n^3.
// The two terms cancel along x, leaving c eps / n^3 there: a small vector
// (one element, Dk = 1, is all along x) would lose that difference to float32
// rounding, so these two dot products and the difference are in float64.
template <typename T>
void qk_grad_reduce(
    const GatedDeltaParams& p,
    const float* head_grads,
    int64_t head_stride,
    const T* raw,
    float* sum,
    float* x,
    T* out) {
  const int dk = p.key_dim;
  const int ratio = p.value_heads / p.key_heads;
  std::fill(sum, sum + dk, 0.0f);
  for (int n = 0; n < ratio; ++n) {
    axpy(1.0f, head_grads + n * head_stride, sum, dk);
  }
  if (p.normalize_qk) {
    load_vector(raw, x, dk);
    // In dot's lanes and tree: one chain of Dk float64 adds waited on each
    // add, and took a third of this function's time.
    double squares_lanes[kDotLanes] = {}, projection_lanes[kDotLanes] = {};
    for (int first = 0; first < dk; first += kDotLanes) {
      const int width = std::min(int(kDotLanes), dk - first);
      for (int l = 0; l < width; ++l) {
        const double x_c = x[first + l];
        squares_lanes[l] += x_c * x_c;
        projection_lanes[l] += x_c * sum[first + l];
      }
    }
    const double squares = sum_lanes(squares_lanes);
    const double projection = sum_lanes(projection_lanes);
    const double norm_squared = squares + double(1e-6f);  // the forward's eps
    const double inverse_cube = 1.0 / (norm_squared * std::sqrt(norm_squared));
    for (int c = 0; c < dk; ++c) {
      sum[c] =
          float((sum[c] * norm_squared - x[c] * projection) * inverse_cube);
    }
  }
  for (int c = 0; c < dk; ++c) {
    out[c] = T(sum[c]);
  }
}

}  // namespace

template <typename T>
void gated_delta_backward(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const BackwardBuffers<T>& b) {
  if (algorithm == Algorithm::Auto) {
    throw std::invalid_argument("gated_delta_backward: resolve Auto first");
  }
  const bool chunked = algorithm == Algorithm::Chunked;
  const int dk = p.key_dim;
  const int ratio = p.value_heads / p.key_heads;
  // The problems run in waves of whole key-head groups (batch row, key head:
  // the value heads that read one q and k), about one problem per thread. A
  // wave's per-value-head gradients of the normalised q and k (float32
  // [T, Dk] per problem) are summed over each group before the next wave
  // reuses them: the scratch is a wave's, not one per value head (2 x T x Hv
  // x Dk floats, 256 MiB at Qwen3-Next's shape and T = 8192).
  const int groups = p.batch * p.key_heads;
  const int wave_groups =
      std::min(groups, std::max(1, (thread_count() + ratio - 1) / ratio));
  const int64_t head_size = int64_t(p.tokens) * dk;
  const size_t scratch = size_t(wave_groups) * ratio * head_size;
  std::vector<float> dq_heads(scratch), dk_heads(scratch);

  const int chunks = p.num_chunks();
  for (int first = 0; first < groups; first += wave_groups) {
    const int wave = std::min(wave_groups, groups - first);
    // Problem i of the wave: head i % ratio of group first + i / ratio.
    parallel_for(wave * ratio, [&](int i) {
      const int group = first + i / ratio;
      const int batch = group / p.key_heads;
      const int head = p.value_head_of(group % p.key_heads, i % ratio);
      const BackwardHeadView<T> view = backward_head_view(
          p,
          b,
          batch,
          head,
          dq_heads.data() + i * head_size,
          dk_heads.data() + i * head_size);
      if (chunked) {
        chunked_head_backward(p, view);
      } else {
        recurrent_head_backward(p, view);
      }
    });
    // One task per (group, chunk of tokens).
    parallel_for(wave * chunks, [&](int task) {
      const int g = task / chunks;
      const int group = first + g;
      const int batch = group / p.key_heads, key_head = group % p.key_heads;
      const int start = (task % chunks) * kChunkSize;
      const int end = std::min(p.tokens, start + int(kChunkSize));
      std::vector<float> sum(dk), x(dk);
      const int64_t heads = int64_t(g) * ratio * head_size;
      for (int t = start; t < end; ++t) {
        const int64_t qk =
            ((int64_t(batch) * p.tokens + t) * p.key_heads + key_head) * dk;
        const int64_t row = heads + int64_t(t) * dk;
        qk_grad_reduce(
            p,
            dq_heads.data() + row,
            head_size,
            b.q + qk,
            sum.data(),
            x.data(),
            b.dq + qk);
        qk_grad_reduce(
            p,
            dk_heads.data() + row,
            head_size,
            b.k + qk,
            sum.data(),
            x.data(),
            b.dk + qk);
      }
    });
  }
}

template void gated_delta_backward<float>(
    const GatedDeltaParams&, Algorithm, const BackwardBuffers<float>&);
template void recurrent_chunk_backward_from_entry<float>(
    const GatedDeltaParams&,
    const BackwardHeadView<float>&,
    int,
    int,
    const float*,
    float*);
template void gated_delta_backward<mlx::core::float16_t>(
    const GatedDeltaParams&,
    Algorithm,
    const BackwardBuffers<mlx::core::float16_t>&);
template void recurrent_chunk_backward_from_entry<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::float16_t>&,
    int,
    int,
    const float*,
    float*);
template void gated_delta_backward<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    Algorithm,
    const BackwardBuffers<mlx::core::bfloat16_t>&);
template void recurrent_chunk_backward_from_entry<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const BackwardHeadView<mlx::core::bfloat16_t>&,
    int,
    int,
    const float*,
    float*);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
