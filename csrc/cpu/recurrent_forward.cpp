// The recurrent form of the gated delta rule on the CPU: token by token.
#include <vector>

#include "cpu/kernel_common.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

// ---------------------------------------------------------------------------
// Recurrent form: one pass over the state per token. The first step reads the
// initial state where it lies and writes the output state, so a decode step
// moves the state exactly once (read + write).

// One token's inputs, as every state row reads them.
struct TokenStep {
  const float* q;
  const float* k;
  const float* decays;  // per-key gates: exp(g) of each column, else unused
  const float* predict_k;  // the prediction's: decays * k per key, else k
  float decay;  // scalar gates: exp(g)
  float beta;
  float scale;
};

// State rows whose predictions one call of step_rows sums together.
constexpr int kRowBlock = 4;

// `Rows` consecutive state rows of one token's step, from old_rows into rows
// (the same rows for an update in place), and their outputs y. A row's
// prediction S k and readout S q are chains of dependent multiply-adds, each
// waiting on the one before. The predictions of a block's rows are summed
// side by side, independent chains that the core overlaps; each row's update
// then sums its readout as it writes the new values, so a row is read twice
// (from memory, then from L1) and written once. Every row's sums are dot's:
// its lanes, its order, so neither the block nor the fusion changes a bit.
// Tail: Dk is not a multiple of kDotLanes (the loops over the lanes then
// index them by a variable, which leaves them on the stack rather than in
// registers, so the common sizes compile without it).
template <bool PerKey, int Rows, bool Tail, typename T>
void step_rows(
    const TokenStep& x,
    int dk,
    const float* old_rows,
    float* rows,
    const float* v,
    T* y) {
  const int whole = Tail ? dk - dk % kDotLanes : dk;
  float lanes[Rows][kDotLanes] = {};
  for (int i = 0; i < whole; i += kDotLanes) {
    for (int r = 0; r < Rows; ++r) {
      for (int l = 0; l < kDotLanes; ++l) {
        lanes[r][l] = multiply_add(
            old_rows[r * dk + i + l], x.predict_k[i + l], lanes[r][l]);
      }
    }
  }
  if constexpr (Tail) {
    for (int r = 0; r < Rows; ++r) {
      for (int c = whole; c < dk; ++c) {
        lanes[r][c - whole] = multiply_add(
            old_rows[r * dk + c], x.predict_k[c], lanes[r][c - whole]);
      }
    }
  }
  float delta[Rows];
  for (int r = 0; r < Rows; ++r) {
    const float sum = sum_lanes(lanes[r]);
    const float predicted = PerKey ? sum : x.decay * sum;
    delta[r] = x.beta * (v[r] - predicted);
  }
  // The row's stores could alias x's fields as far as the compiler knows:
  // copies in registers spare a reload per vector.
  const float decay = x.decay;
  const float* decays = x.decays;
  const float* k = x.k;
  const float* q = x.q;
  for (int r = 0; r < Rows; ++r) {
    const float* old_row = old_rows + r * dk;
    float* row = rows + r * dk;
    const float row_delta = delta[r];
    float readout[kDotLanes] = {};
    // Each c reads old_row[c] before it writes row[c], and no other: an
    // update in place (row == old_row) vectorises as well.
    for (int i = 0; i < whole; i += kDotLanes) {
#pragma omp simd
      for (int l = 0; l < kDotLanes; ++l) {
        const int c = i + l;
        const float value =
            (PerKey ? decays[c] : decay) * old_row[c] + row_delta * k[c];
        row[c] = value;
        readout[l] = multiply_add(value, q[c], readout[l]);
      }
    }
    if constexpr (Tail) {
      for (int c = whole; c < dk; ++c) {
        const float value =
            (PerKey ? decays[c] : decay) * old_row[c] + row_delta * k[c];
        row[c] = value;
        readout[c - whole] = multiply_add(value, q[c], readout[c - whole]);
      }
    }
    y[r] = T(x.scale * sum_lanes(readout));
  }
}

// A decode step reads each state once from memory, and one core alone
// keeps too few of its lines in flight to reach the memory's bandwidth: its
// rows must be asked for before the loads reach them. So a step from one
// buffer into another (a call's first token: the old state is the caller's,
// the new one not yet touched) first asks, for each row block, for the lines
// kPrefetchRows rows ahead, of the old state (to read) and of the new one (to
// write: taking its lines for writing early spares the store a wait). Later
// tokens update the head's state in place, in cache, where the hints would
// only cost instructions (1-4% at T=32). On the 2-core Xeon measured, two
// blocks ahead took the Qwen3-Next decode step (B=1, the states rotated
// through memory) from 64-66% to 79-87% of the copy bandwidth; one block
// ahead and four gained less, the old state alone about half of it
// (docs/cpu.md, "The decode step"). The hints change no result. They
// stay written out in step_state's loop: moved into a helper function of
// their own, GCC 12's dead-code elimination removed every one (seen in the
// objects of all three levels), so a change here should be checked there.
constexpr int kPrefetchRows = 2 * kRowBlock;
constexpr int kLineFloats = 64 / sizeof(float);

template <bool PerKey, typename T>
void step_state(
    const TokenStep& x,
    int dk,
    int dv,
    const float* source,
    float* destination,
    const float* v,
    T* y) {
  const bool prefetch = source != destination;
  int r = 0;
  if (dk % kDotLanes == 0) {
    for (; r + kRowBlock <= dv; r += kRowBlock) {
      if (prefetch && r + kPrefetchRows + kRowBlock <= dv) {
        const int64_t ahead = int64_t(r + kPrefetchRows) * dk;
        for (int e = 0; e < kRowBlock * dk; e += kLineFloats) {
          __builtin_prefetch(source + ahead + e, 0);
          __builtin_prefetch(destination + ahead + e, 1);
        }
      }
      step_rows<PerKey, kRowBlock, false>(
          x,
          dk,
          source + int64_t(r) * dk,
          destination + int64_t(r) * dk,
          v + r,
          y + r);
    }
  }
  for (; r < dv; ++r) {
    step_rows<PerKey, 1, true>(
        x,
        dk,
        source + int64_t(r) * dk,
        destination + int64_t(r) * dk,
        v + r,
        y + r);
  }
}

// The float32 inputs of one token, which recurrent_step loads: q, k (Dk
// each), v (Dv) and, with per-key gates, the decays and k scaled by them (Dk
// each; the prediction reads the decayed state: sum_c S_rc exp(g_c) k_c).
class StepScratch {
 public:
  explicit StepScratch(const GatedDeltaParams& p)
      : floats_(
            3 * p.key_dim + p.value_dim +
            (p.per_key_gates ? 2 * p.key_dim : 0)),
        q(floats_.data()),
        k(q + p.key_dim),
        v(k + p.key_dim),
        decays(v + p.value_dim),
        decayed_k(decays + p.key_dim) {}
  StepScratch(const StepScratch&) = delete;
  StepScratch& operator=(const StepScratch&) = delete;

 private:
  std::vector<float> floats_;

 public:
  float* const q;
  float* const k;
  float* const v;
  float* const decays;  // per-key gates only
  float* const decayed_k;  // per-key gates only
};

// One token's step: from the state at `source` to the state at `destination`
// (they may be the same buffer), writing the token's output row.
template <typename T>
void recurrent_step(
    const GatedDeltaParams& p,
    const HeadView<T>& h,
    int t,
    const float* source,
    float* destination,
    StepScratch& scratch) {
  const int dk = p.key_dim, dv = p.value_dim;
  float* q = scratch.q;
  float* k = scratch.k;
  float* v = scratch.v;
  load_qk_vector(h.q + t * h.qk_token_stride, q, dk, p.normalize_qk);
  load_qk_vector(h.k + t * h.qk_token_stride, k, dk, p.normalize_qk);
  load_vector(h.v + t * h.v_token_stride, v, dv);
  const float* g = h.g + t * h.g_token_stride;
  TokenStep x{q, k, nullptr, k, 0.0f, h.beta[t * h.gate_token_stride], p.scale};
  T* y = h.y + t * h.y_token_stride;
  if (p.per_key_gates) {
    float* decays = scratch.decays;
    float* decayed_k = scratch.decayed_k;
    for (int c = 0; c < dk; ++c) {
      decays[c] = std::exp(g[c]);  // g = -inf: exactly 0, a wipe of column c
      decayed_k[c] = decays[c] * k[c];
    }
    x.decays = decays;
    x.predict_k = decayed_k;
    step_state<true>(x, dk, dv, source, destination, v, y);
  } else {
    x.decay = std::exp(g[0]);
    step_state<false>(x, dk, dv, source, destination, v, y);
  }
}

// Tree verification: token t steps from its parent's state (the initial
// state for -1), so every token's state is kept until the call ends. The
// final state is the last token's.
template <typename T>
void tree_head(const GatedDeltaParams& p, const HeadView<T>& h) {
  const int dk = p.key_dim, dv = p.value_dim;
  const int64_t state_size = int64_t(dv) * dk;
  StepScratch scratch(p);
  std::vector<float> initial(state_size), nodes(p.tokens * state_size);
  copy_state(p, h.state_in, initial.data());
  int next_checkpoint = 0;
  for (int t = 0; t < p.tokens; ++t) {
    const float* source =
        h.parents[t] < 0 ? initial.data() : &nodes[h.parents[t] * state_size];
    float* node = &nodes[t * state_size];
    if (h.mask && !h.mask[t]) {
      zero_output_row(h.y + t * h.y_token_stride, dv);
      copy_state(p, source, node);
    } else {
      recurrent_step(p, h, t, source, node, scratch);
    }
    if (next_checkpoint < h.checkpoint_count &&
        h.checkpoints[next_checkpoint] == t + 1) {
      copy_state(p, node, checkpoint_slot(h, next_checkpoint));
      ++next_checkpoint;
    }
  }
  copy_state(p, &nodes[(p.tokens - 1) * state_size], h.state);
}

template <typename T>
void recurrent_head(const GatedDeltaParams& p, const HeadView<T>& h) {
  if (h.parents) {
    tree_head(p, h);
    return;
  }
  const int dv = p.value_dim;
  StepScratch scratch(p);
  if (!h.state_in) {
    copy_state(p, nullptr, h.state);
  }
  const float* source = h.state_in ? h.state_in : h.state;
  int next_checkpoint = 0;
  for (int t = 0; t < p.tokens; ++t) {
    if (h.mask && !h.mask[t]) {
      zero_output_row(h.y + t * h.y_token_stride, dv);
    } else {
      recurrent_step(p, h, t, source, h.state, scratch);
      source = h.state;
    }
    // A checkpoint is a copy of the state after its token, masked or not.
    if (next_checkpoint < h.checkpoint_count &&
        h.checkpoints[next_checkpoint] == t + 1) {
      copy_state(p, source, checkpoint_slot(h, next_checkpoint));
      ++next_checkpoint;
    }
  }
  if (source != h.state) {  // every step was masked
    copy_state(p, source, h.state);
  }
}

template void recurrent_head<float>(
    const GatedDeltaParams&, const HeadView<float>&);
template void recurrent_head<mlx::core::float16_t>(
    const GatedDeltaParams&, const HeadView<mlx::core::float16_t>&);
template void recurrent_head<mlx::core::bfloat16_t>(
    const GatedDeltaParams&, const HeadView<mlx::core::bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
