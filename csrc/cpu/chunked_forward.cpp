// The chunked WY/UT form of the gated delta rule on the CPU.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "cpu/chunked_stages.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// qk_norm: the chunk's q and k rows as float32, L2-normalised when asked.
// The rows are copied first and normalised after: a copy loop keeps many
// rows' loads in flight, where a per-row norm would wait on each row.
template <typename T>
void qk_norm(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s) {
  const int dk = p.key_dim;
  for (int i = 0; i < L; ++i) {
    const int t = start + i;
    s.active[i] = !h.mask || h.mask[t];
    load_vector(h.q + t * h.qk_token_stride, &s.q[i * dk], dk);
    load_vector(h.k + t * h.qk_token_stride, &s.k[i * dk], dk);
  }
  if (p.normalize_qk) {
    for (int i = 0; i < L; ++i) {
      normalize(&s.q[i * dk], dk);
      normalize(&s.k[i * dk], dk);
    }
  }
}

// k_gram: the undecayed K K^T (lower triangle), once per key head; also
// leaves K^T for chunk_qk.
void k_gram(int dk, int L, ChunkScratch& s) {
  constexpr int C = kChunkSize;
  transpose(s.k.data(), L, dk, dk, s.k_transposed.data(), C);
  fill_zero(s.k_gram);
  gemm(
      L,
      L,
      dk,
      1.0f,
      {s.k.data(), dk, 1},
      s.k_transposed.data(),
      C,
      s.k_gram.data(),
      C,
      Triangle::LowerC);
}

// chunk_qk: the undecayed Q K^T (lower triangle), once per key head.
void chunk_qk(int dk, int L, ChunkScratch& s) {
  constexpr int C = kChunkSize;
  fill_zero(s.qk);
  gemm(
      L,
      L,
      dk,
      1.0f,
      {s.q.data(), dk, 1},
      s.k_transposed.data(),
      C,
      s.qk.data(),
      C,
      Triangle::LowerC);
}

// gate_cumsum: one value head's gates and betas for the chunk, and its decay
// matrix. A masked token is a step that changes nothing: decay 1 and beta 0
// make its delta vanish.
template <typename T>
void gate_cumsum(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s) {
  for (int i = 0; i < L; ++i) {
    const int t = start + i;
    s.beta[i] = s.active[i] ? h.beta[t * h.gate_token_stride] : 0.0f;
  }
  if (p.per_key_gates) {
    s.key_decays.compute(
        h.g + start * h.g_token_stride,
        h.g_token_stride,
        s.active,
        L,
        p.key_dim);
    return;
  }
  for (int i = 0; i < L; ++i) {
    s.g[i] = h.g[(start + i) * h.g_token_stride];
  }
  s.decays.compute(s.g, s.active, L);
  s.decays.lower_matrix(s.decay.data());
}

// key_decayed_grams (per-key gates): one value head's decayed K K^T (A
// before beta) in k_gram and decayed Q K^T in qk_decayed, from the decays
// gate_cumsum formed; in place of k_gram and chunk_qk, whose undecayed grams
// the per-channel decays cannot be applied to.
void key_decayed_grams(ChunkScratch& s) {
  s.key_decays.decayed_grams(
      s.q.data(),
      s.k.data(),
      s.k_transposed.data(),
      s.k_gram.data(),
      s.qk_decayed.data());
}

// kkt_inverse: A_ij = beta_i decay(i, j) k_i.k_j below the diagonal, then
// T = (I + A)^-1 row by row: T_i = e_i - sum_{m<i} A_im T_m, the terms added
// in order of m. Entries above the diagonal stay 0.
void kkt_inverse(const GatedDeltaParams& p, int L, ChunkScratch& s) {
  constexpr int C = kChunkSize;
  for (int i = 0; i < L; ++i) {
    for (int j = 0; j < L; ++j) {
      // Per-key gates: k_gram holds key_decayed_grams' decayed gram.
      const float decayed_gram = p.per_key_gates
          ? s.k_gram[i * C + j]
          : s.decay[i * C + j] * s.k_gram[i * C + j];
      s.a[i * C + j] = j < i ? s.beta[i] * decayed_gram : 0.0f;
    }
  }
  // Each row is built in two halves of fixed length, locals the compiler
  // keeps in registers: no short tails, and no row waits on its own stores.
  // Past its diagonal T_m is exactly +0, and -A_im * 0 added to an entry
  // leaves it as it was, so the sums are those of the first m + 1 entries
  // alone, bit for bit. Hence the right half, zero in the rows m < C / 2,
  // takes only the terms of the rows past them: a third less work than whole
  // rows, the same bits.
  constexpr int half = C / 2;
  for (int i = 0; i < L; ++i) {
    float left[half], right[half];
#pragma omp simd
    for (int j = 0; j < half; ++j) {
      left[j] = j == i ? 1.0f : 0.0f;
      right[j] = half + j == i ? 1.0f : 0.0f;
    }
    for (int m = 0; m < std::min(i, half); ++m) {
      const float factor = -s.a[i * C + m];
      const float* t_m = s.inverse.data() + m * C;
#pragma omp simd
      for (int j = 0; j < half; ++j) {
        left[j] = multiply_add(factor, t_m[j], left[j]);
      }
    }
    for (int m = half; m < i; ++m) {
      const float factor = -s.a[i * C + m];
      const float* t_m = s.inverse.data() + m * C;
#pragma omp simd
      for (int j = 0; j < half; ++j) {
        left[j] = multiply_add(factor, t_m[j], left[j]);
        right[j] = multiply_add(factor, t_m[half + j], right[j]);
      }
    }
    std::copy(left, left + half, s.inverse.data() + i * C);
    std::copy(right, right + half, s.inverse.data() + i * C + half);
  }
}

// recompute_w_u: U = T diag(beta) V, W = T diag(beta decay(i,-1)) K.
template <typename T>
void recompute_w_u(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s) {
  const int dk = p.key_dim, dv = p.value_dim;
  // v's rows converted and scaled in one pass (the conversion is exact).
  for (int i = 0; i < L; ++i) {
    const T* v = h.v + (start + i) * h.v_token_stride;
    for (int c = 0; c < dv; ++c) {
      s.scaled_v[i * dv + c] = static_cast<float>(v[c]) * s.beta[i];
    }
  }
  for (int i = 0; i < L; ++i) {
    if (p.per_key_gates) {
      const float* from_start = s.key_decays.from_start() + i * dk;
      for (int c = 0; c < dk; ++c) {
        s.scaled_k[i * dk + c] = s.beta[i] * from_start[c] * s.k[i * dk + c];
      }
      continue;
    }
    const float w_scale = s.beta[i] * s.decays.from_start(i);
    for (int c = 0; c < dk; ++c) {
      s.scaled_k[i * dk + c] = w_scale * s.k[i * dk + c];
    }
  }
  const MatrixA t_rows{s.inverse.data(), kChunkSize, 1};
  gemm(
      L,
      dv,
      L,
      1.0f,
      t_rows,
      s.scaled_v.data(),
      dv,
      s.u.data(),
      dv,
      Triangle::LowerA,
      Output::Overwrite);
  gemm(
      L,
      dk,
      L,
      1.0f,
      t_rows,
      s.scaled_k.data(),
      dk,
      s.w.data(),
      dk,
      Triangle::LowerA,
      Output::Overwrite);
}

// chunk_carry, in two steps around chunk_output. The first: V' = U - W S0^T
// (the deltas, now that the entry state is known) and the inter-chunk output
// decay(i,-1) S0 q_i.
void chunk_carry(
    const GatedDeltaParams& p, int L, ChunkScratch& s, const float* state_t) {
  const int dk = p.key_dim, dv = p.value_dim;
  gemm(L, dv, dk, -1.0f, {s.w.data(), dk, 1}, state_t, dv, s.u.data(), dv);

  // The inter-chunk output S0 (decay(i, -1) q_i). Per-key gates: the decays
  // scale q's channels first (into scaled_k, free until chunk_carry_state);
  // scalar gates: the output rows after.
  const float* queries = s.q.data();
  if (p.per_key_gates) {
    const float* from_start = s.key_decays.from_start();
    for (int e = 0; e < L * dk; ++e) {
      s.scaled_k[e] = from_start[e] * s.q[e];
    }
    queries = s.scaled_k.data();
  }
  gemm(
      L,
      dv,
      dk,
      1.0f,
      {queries, dk, 1},
      state_t,
      dv,
      s.y.data(),
      dv,
      Triangle::None,
      Output::Overwrite);
  if (p.per_key_gates) {
    return;
  }
  for (int i = 0; i < L; ++i) {
    const float d = s.decays.from_start(i);
    for (int c = 0; c < dv; ++c) {
      s.y[i * dv + c] *= d;
    }
  }
}

// The second: the exit state S_end^T = decay(L-1,-1) S0^T
// + (diag(decay(L-1, j)) K)^T V'. It runs after chunk_output, which reads the
// output rows chunk_carry just wrote while they are still in cache.
void chunk_carry_state(
    const GatedDeltaParams& p, int L, ChunkScratch& s, float* state_t) {
  const int dk = p.key_dim, dv = p.value_dim;
  if (p.per_key_gates) {
    // Row c of the transposed state is the state's column c.
    const float* chunk_decays = s.key_decays.from_start() + (L - 1) * dk;
    for (int c = 0; c < dk; ++c) {
      for (int e = 0; e < dv; ++e) {
        state_t[int64_t(c) * dv + e] *= chunk_decays[c];
      }
    }
    const float* to_end = s.key_decays.to_end();
    for (int e = 0; e < L * dk; ++e) {
      s.scaled_k[e] = to_end[e] * s.k[e];
    }
  } else {
    const float chunk_decay = s.decays.from_start(L - 1);
    for (int64_t e = 0; e < int64_t(dk) * dv; ++e) {
      state_t[e] *= chunk_decay;
    }
    for (int j = 0; j < L; ++j) {
      const float d = s.decays.to_end(j);
      for (int c = 0; c < dk; ++c) {
        s.scaled_k[j * dk + c] = d * s.k[j * dk + c];
      }
    }
  }
  gemm(
      dk, dv, L, 1.0f, {s.scaled_k.data(), 1, dk}, s.u.data(), dv, state_t, dv);
}

template void qk_norm<float>(
    const GatedDeltaParams&, const HeadView<float>&, int, int, ChunkScratch&);
template void qk_norm<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::float16_t>&,
    int,
    int,
    ChunkScratch&);
template void qk_norm<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::bfloat16_t>&,
    int,
    int,
    ChunkScratch&);
template void gate_cumsum<float>(
    const GatedDeltaParams&, const HeadView<float>&, int, int, ChunkScratch&);
template void gate_cumsum<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::float16_t>&,
    int,
    int,
    ChunkScratch&);
template void gate_cumsum<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::bfloat16_t>&,
    int,
    int,
    ChunkScratch&);
template void recompute_w_u<float>(
    const GatedDeltaParams&, const HeadView<float>&, int, int, ChunkScratch&);
template void recompute_w_u<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::float16_t>&,
    int,
    int,
    ChunkScratch&);
template void recompute_w_u<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::bfloat16_t>&,
    int,
    int,
    ChunkScratch&);

namespace {

// chunk_output: y_i = scale (inter_i + sum_{j<=i} decay(i,j) q_i.k_j V'_j);
// a masked token's output row is written as 0.
template <typename T>
void chunk_output(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    ChunkScratch& s) {
  const int dv = p.value_dim;
  constexpr int C = kChunkSize;
  // Per-key gates: key_decayed_grams built qk_decayed already.
  for (int i = 0; !p.per_key_gates && i < L; ++i) {
    for (int j = 0; j < L; ++j) {
      // The decay matrix is 0 above the diagonal.
      s.qk_decayed[i * C + j] = s.decay[i * C + j] * s.qk[i * C + j];
    }
  }
  gemm(
      L,
      dv,
      L,
      1.0f,
      {s.qk_decayed.data(), C, 1},
      s.u.data(),
      dv,
      s.y.data(),
      dv,
      Triangle::LowerA);
  for (int i = 0; i < L; ++i) {
    T* y = h.y + (start + i) * h.y_token_stride;
    if (!s.active[i]) {
      zero_output_row(y, dv);
      continue;
    }
    for (int c = 0; c < dv; ++c) {
      y[c] = T(p.scale * s.y[i * dv + c]);
    }
  }
}

// chunk_checkpoint: for each checkpoint p inside the chunk (start < p <=
// start + L), the state after its first i = p - start tokens, from the
// chunk's entry state `entry_t` ([Dk, Dv]) and V' (in s.u after chunk_carry),
// written untransposed ([Dv, Dk]) to the checkpoint's slot. Returns the index
// of the first checkpoint past the chunk.
template <typename T>
int chunk_checkpoint(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int start,
    int L,
    int next,
    const float* entry_t,
    ChunkScratch& s,
    std::vector<float>& cut_t) {
  const int dk = p.key_dim, dv = p.value_dim;
  for (; next < h.checkpoint_count && h.checkpoints[next] <= start + L;
       ++next) {
    const int i =
        h.checkpoints[next] - start;  // tokens of the chunk before the cut
    if (p.per_key_gates) {
      // As chunk_carry_state, cut after i tokens: row c of the transposed
      // state decays by its own channel's decay.
      for (int c = 0; c < dk; ++c) {
        const float decay_from_start = s.key_decays(i - 1, -1, c);
        for (int e = 0; e < dv; ++e) {
          cut_t[int64_t(c) * dv + e] =
              decay_from_start * entry_t[int64_t(c) * dv + e];
        }
      }
      for (int j = 0; j < i; ++j) {
        for (int c = 0; c < dk; ++c) {
          s.scaled_k[j * dk + c] = s.key_decays(i - 1, j, c) * s.k[j * dk + c];
        }
      }
    } else {
      const float decay_from_start = s.decays.from_start(i - 1);
      for (int64_t e = 0; e < int64_t(dk) * dv; ++e) {
        cut_t[e] = decay_from_start * entry_t[e];
      }
      for (int j = 0; j < i; ++j) {
        const float d = s.decays(i - 1, j);
        for (int c = 0; c < dk; ++c) {
          s.scaled_k[j * dk + c] = d * s.k[j * dk + c];
        }
      }
    }
    gemm(
        dk,
        dv,
        i,
        1.0f,
        {s.scaled_k.data(), 1, dk},
        s.u.data(),
        dv,
        cut_t.data(),
        dv);
    transpose(cut_t.data(), dk, dv, dv, checkpoint_slot(h, next), dk);
  }
  return next;
}

// The stages a trace records, in pipeline order.
enum class Stage {
  QkNorm,
  GateCumsum,
  KeyDecayedGrams,
  KGram,
  ChunkQk,
  KktInverse,
  RecomputeWU,
  ChunkCarry,
  ChunkCarryState
};

// Copies `rows` rows of `cols` values (row stride `ld`) into chunk `chunk`'s
// slot of `rows_per_chunk` x `cols` in `out`, growing it to hold the chunk.
template <typename V>
void record_rows(
    std::vector<V>& out,
    int chunk,
    int rows_per_chunk,
    int cols,
    const V* in,
    int rows,
    int64_t ld) {
  const size_t slot = size_t(rows_per_chunk) * cols;
  out.resize(std::max(out.size(), (chunk + 1) * slot), V(0));
  V* dst = out.data() + chunk * slot;
  for (int r = 0; r < rows; ++r) {
    std::copy(in + r * ld, in + r * ld + cols, dst + size_t(r) * cols);
  }
}

// Records what `stage` just left in the scratch (and, for the state, in the
// transposed state `state_t`).
void record_stage(
    Stage stage,
    const GatedDeltaParams& p,
    int chunk,
    int L,
    const ChunkScratch& s,
    const float* state_t,
    ChunkedTrace& t) {
  constexpr int C = kChunkSize;
  const int dk = p.key_dim, dv = p.value_dim;
  t.chunks = std::max(t.chunks, chunk + 1);
  switch (stage) {
    case Stage::QkNorm:
      record_rows(t.q, chunk, C, dk, s.q.data(), L, dk);
      record_rows(t.k, chunk, C, dk, s.k.data(), L, dk);
      return;
    case Stage::GateCumsum: {
      // Only the first L entries are the chunk's; the rest stay 0. Per-key
      // gates: Dk of each.
      const int width = p.per_key_gates ? dk : 1;
      std::vector<float> log_sum(size_t(C) * width, 0.0f);
      std::vector<int> last_wipe(size_t(C) * width, 0);
      float beta[C] = {};
      for (int i = 0; i < L; ++i) {
        for (int c = 0; c < width; ++c) {
          const bool per_key = p.per_key_gates;
          log_sum[i * width + c] =
              per_key ? s.key_decays.log_sum(i, c) : s.decays.log_sum(i);
          last_wipe[i * width + c] =
              per_key ? s.key_decays.last_wipe(i, c) : s.decays.last_wipe(i);
        }
        beta[i] = s.beta[i];
      }
      record_rows(t.log_cumsum, chunk, C, width, log_sum.data(), C, width);
      record_rows(t.last_wipe, chunk, C, width, last_wipe.data(), C, width);
      record_rows(t.beta, chunk, 1, C, beta, 1, C);
      return;
    }
    case Stage::KeyDecayedGrams:
      record_rows(t.k_gram, chunk, C, C, s.k_gram.data(), L, C);
      record_rows(t.qk, chunk, C, C, s.qk_decayed.data(), L, C);
      return;
    case Stage::KGram:
      record_rows(t.k_gram, chunk, C, C, s.k_gram.data(), L, C);
      return;
    case Stage::ChunkQk:
      record_rows(t.qk, chunk, C, C, s.qk.data(), L, C);
      return;
    case Stage::KktInverse:
      record_rows(t.inverse, chunk, C, C, s.inverse.data(), L, C);
      return;
    case Stage::RecomputeWU:
      record_rows(t.w, chunk, C, dk, s.w.data(), L, dk);
      record_rows(t.u, chunk, C, dv, s.u.data(), L, dv);
      return;
    case Stage::ChunkCarry:
      record_rows(t.corrected, chunk, C, dv, s.u.data(), L, dv);
      record_rows(t.output_inter, chunk, C, dv, s.y.data(), L, dv);
      return;
    case Stage::ChunkCarryState: {
      std::vector<float> state(size_t(dv) * dk);
      transpose(state_t, dk, dv, dv, state.data(), dk);
      record_rows(t.state, chunk, dv, dk, state.data(), dv, dk);
      return;
    }
  }
}

}  // namespace

template <typename T>
void chunked_heads(
    const GatedDeltaParams& p,
    const HeadView<T>* heads,
    int head_count,
    ChunkedTrace* trace) {
  if (trace && head_count != 1) {
    throw std::invalid_argument("a chunked trace runs one head");
  }
  ChunkScratch s(p.key_dim, p.value_dim);
  const int dk = p.key_dim, dv = p.value_dim;
  constexpr int C = kChunkSize;
  const HeadView<T>& first = heads[0];  // q, k and the mask are shared

  // Each head's state, transposed to [Dk, Dv] while the chunks run.
  std::vector<float> states(size_t(head_count) * dk * dv, 0.0f);
  for (int n = 0; n < head_count; ++n) {
    if (heads[n].state_in) {
      transpose(
          heads[n].state_in, dv, dk, dk, &states[size_t(n) * dk * dv], dv);
    }
  }

  // With checkpoints: each head's next checkpoint, and the entry state of
  // the chunk (chunk_carry overwrites it) and the cut state of
  // chunk_checkpoint.
  std::vector<int> next_checkpoint(head_count, 0);
  std::vector<float> entry_t, cut_t;
  if (first.checkpoint_count > 0) {
    entry_t.resize(size_t(dk) * dv);
    cut_t.resize(size_t(dk) * dv);
  }

  for (int start = 0; start < p.tokens; start += C) {
    const int L = std::min(C, p.tokens - start);
    // Records a stage's output when traced; nothing otherwise.
    auto traced = [&](Stage stage, const float* state_t) {
      if (trace) {
        record_stage(stage, p, start / C, L, s, state_t, *trace);
      }
    };

    // Once per key head, shared by its value heads.
    qk_norm(p, first, start, L, s);
    traced(Stage::QkNorm, nullptr);
    // The next chunk's rows load while this chunk's products run: its q and
    // k rows here, its per-key gate rows with each value head's.
    const int next_start = start + C;
    const int next_L = std::min(C, p.tokens - next_start);
    if (next_L > 0) {
      const int64_t next = int64_t(next_start) * first.qk_token_stride;
      prefetch_rows(first.q + next, next_L, first.qk_token_stride, dk);
      prefetch_rows(first.k + next, next_L, first.qk_token_stride, dk);
    }
    // With per-key gates the grams depend on each value head's decays:
    // gate_cumsum builds them decayed, per value head.
    if (p.per_key_gates) {
      transpose(s.k.data(), L, dk, dk, s.k_transposed.data(), C);
    } else {
      k_gram(dk, L, s);
      traced(Stage::KGram, nullptr);
      chunk_qk(dk, L, s);
      traced(Stage::ChunkQk, nullptr);
    }
    for (int n = 0; n < head_count; ++n) {
      const HeadView<T>& h = heads[n];
      float* state_t = &states[size_t(n) * dk * dv];
      gate_cumsum(p, h, start, L, s);
      traced(Stage::GateCumsum, nullptr);
      // This chunk's v rows load while the grams are built (recompute_w_u
      // reads them).
      prefetch_rows(h.v + start * h.v_token_stride, L, h.v_token_stride, dv);
      if (p.per_key_gates) {
        if (next_L > 0) {
          prefetch_rows(
              h.g + next_start * h.g_token_stride,
              next_L,
              h.g_token_stride,
              dk);
        }
        key_decayed_grams(s);
        traced(Stage::KeyDecayedGrams, nullptr);
      }
      kkt_inverse(p, L, s);
      traced(Stage::KktInverse, nullptr);
      recompute_w_u(p, h, start, L, s);
      traced(Stage::RecomputeWU, nullptr);
      const bool checkpoint_in_chunk =
          next_checkpoint[n] < h.checkpoint_count &&
          h.checkpoints[next_checkpoint[n]] <= start + L;
      if (checkpoint_in_chunk) {
        std::copy(state_t, state_t + size_t(dk) * dv, entry_t.begin());
      }
      chunk_carry(p, L, s, state_t);
      traced(Stage::ChunkCarry, nullptr);
      if (checkpoint_in_chunk) {
        next_checkpoint[n] = chunk_checkpoint(
            p, h, start, L, next_checkpoint[n], entry_t.data(), s, cut_t);
      }
      chunk_output(p, h, start, L, s);
      chunk_carry_state(p, L, s, state_t);
      traced(Stage::ChunkCarryState, state_t);
    }
  }
  for (int n = 0; n < head_count; ++n) {
    transpose(&states[size_t(n) * dk * dv], dk, dv, dv, heads[n].state, dk);
  }
}

template void chunked_heads<float>(
    const GatedDeltaParams&, const HeadView<float>*, int, ChunkedTrace*);
template void chunked_heads<mlx::core::float16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::float16_t>*,
    int,
    ChunkedTrace*);
template void chunked_heads<mlx::core::bfloat16_t>(
    const GatedDeltaParams&,
    const HeadView<mlx::core::bfloat16_t>*,
    int,
    ChunkedTrace*);

ChunkedTrace trace_chunked_stages(
    const GatedDeltaParams& p,
    const CoreBuffers<float>& buffers,
    int batch,
    int head) {
  const HeadView<float> h = head_view(p, buffers, batch, head);
  ChunkedTrace trace;
  chunked_heads(p, &h, 1, &trace);
  return trace;
}

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
