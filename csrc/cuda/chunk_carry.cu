// chunk_carry: the chunked form's sequential pass (chunked_common.cuh).
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// A block keeps kCarryBlockRows rows of the state (launch_shapes.h) in the
// accumulators of its warps' m16n8k8 products (tensor_core.cuh's mma_tf32):
// warp w the rows 16 (w / 4) to 16 (w / 4) + 15 of the block and the
// columns 32 (w % 4) to 32 (w % 4) + 31, for the whole pass. Lane (g, t)
// (g = lane / 4, t = lane % 4) holds, for each of the warp's column tiles n
// (8 columns from 32 (w % 4) + 8 n), the rows g and g + 8 of the warp's
// rows at the columns 2t and 2t + 1 of the tile.
constexpr int kRowTiles = kCarryBlockRows / kTile;
constexpr int kGroupColumns = kChunkedMaxDim / kCarryColumnGroups;
constexpr int kColumnTiles = kGroupColumns / 8;
constexpr int kTokenTiles = kChunk / kTile;
static_assert(
    kRowTiles * kCarryColumnGroups * kWarp == kChunkedThreads,
    "a warp for each (row tile, column group)");
static_assert(kCarryBlockRows == kWarp, "v' a token row a warp, a row a lane");

using StateTiles = float[kColumnTiles][4];

// One stage of a chunk's inputs in shared memory (kCarryStageFloats).
struct CarryStage {
  float* w;  // [kChunk][kCarryWStride]: W, 0 past tile_padded(Dk)
  float* k;  // [kChunk][kCarryKStride]: K as the inputs give it, likewise
  float* u;  // [kChunk][kCarryRowStride]: the block's columns of U, then v'
  float* decays;  // [kDecayRows][kChunk] (ChunkScratch)
  float* column_decays;  // [kChunkedMaxDim] (ChunkScratch)

  __device__ explicit CarryStage(float* base)
      : w(base),
        k(w + kChunk * kCarryWStride),
        u(k + kChunk * kCarryKStride),
        decays(u + kChunk * kCarryRowStride),
        column_decays(decays + kDecayRows * kChunk) {}
};

__device__ inline CarryStage carry_stage(float* shared, int n) {
  return CarryStage(shared + n * kCarryStageFloats);
}

// A chunk's W, K, the block's columns of U (those within U's tile_padded(Dv)
// columns; the rest stay 0) and its decays, copied asynchronously. K is
// the key head's (scalar gates) or the value head's (per-key gates) at
// key_index.
__device__ void copy_chunk_async(
    const ChunkScratch& s,
    int64_t index,
    int64_t key_index,
    int kw,
    int vw,
    int row0,
    const CarryStage& stage) {
  copy_rows_async(
      s.w + index * kChunk * kw, kw, kChunk, kw, stage.w, kCarryWStride);
  copy_rows_async(
      s.k + key_index * kChunk * kw, kw, kChunk, kw, stage.k, kCarryKStride);
  constexpr int kVectors = kCarryBlockRows / 4;
  for (int e = threadIdx.x; e < kChunk * kVectors; e += kChunkedThreads) {
    const int i = e / kVectors, c = 4 * (e % kVectors);
    if (row0 + c < vw) {
      __pipeline_memcpy_async(
          stage.u + i * kCarryRowStride + c,
          s.u + (index * kChunk + i) * vw + row0 + c,
          16);
    }
  }
  static_assert(
      kDecayRows * kChunk <= 4 * kChunkedThreads, "one decay vector a thread");
  if (4 * threadIdx.x < kDecayRows * kChunk) {
    __pipeline_memcpy_async(
        stage.decays + 4 * threadIdx.x,
        s.decays + index * kDecayRows * kChunk + 4 * threadIdx.x,
        16);
  }
  static_assert(kChunkedMaxDim <= 4 * kChunkedThreads, "likewise");
  if (4 * threadIdx.x < kChunkedMaxDim) {
    __pipeline_memcpy_async(
        stage.column_decays + 4 * threadIdx.x,
        s.column_decays + index * kChunkedMaxDim + 4 * threadIdx.x,
        16);
  }
}

// The warp's part of the state (or of a checkpoint) into out, the block's
// rows of a [Dv, Dk] state (row stride Dk).
__device__ void store_state(
    const StateTiles& state,
    float* out,
    int dk,
    int rows,
    int tile_row,
    int column0) {
  const int lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = tile_row + g + 8 * half, c = column0 + 8 * n + 2 * t;
      if (r < rows) {
        float* row = out + int64_t(r) * dk;
        const float x = state[n][2 * half], y = state[n][2 * half + 1];
        if (dk % 2 == 0 && c + 1 < dk) {
          *reinterpret_cast<float2*>(row + c) = make_float2(x, y);
        } else {
          if (c < dk) {
            row[c] = x;
          }
          if (c + 1 < dk) {
            row[c + 1] = y;
          }
        }
      }
    }
  }
}

// state += left^T K over the chunk's tokens, for the warp's part of the state:
// left [kChunk][kCarryRowStride] the update's scaled v' (a column a state
// row), K [kChunk][kCarryKStride]. Each m16n8k8 product takes the tokens
// j0 + 2t and j0 + 2t + 1 as its k indices t and t + 4, so that a lane's
// operands are two adjacent rows of left and K. left in 3xTF32 (2xTF32
// where K is exact), its corrections in a second accumulator (Product's
// scheme, tensor_core.cuh).
template <bool kExactKeys>
__device__ __forceinline__ void add_update(
    StateTiles& state,
    const float* left,
    const float* keys,
    int tile_row,
    int column0) {
  const int lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  float correction[kColumnTiles][4] = {};
#pragma unroll
  for (int j0 = 0; j0 < kChunk; j0 += 8) {
    const float* pair = left + (j0 + 2 * t) * kCarryRowStride + tile_row + g;
    const Tf32Parts a0 = split_tf32(pair[0]), a1 = split_tf32(pair[8]);
    const Tf32Parts a2 = split_tf32(pair[kCarryRowStride]);
    const Tf32Parts a3 = split_tf32(pair[kCarryRowStride + 8]);
    const uint32_t hi[4] = {a0.hi, a1.hi, a2.hi, a3.hi};
    const uint32_t lo[4] = {a0.lo, a1.lo, a2.lo, a3.lo};
#pragma unroll
    for (int n = 0; n < kColumnTiles; ++n) {
      const float* column =
          keys + (j0 + 2 * t) * kCarryKStride + column0 + 8 * n + g;
      const float k0 = column[0], k1 = column[kCarryKStride];
      if constexpr (kExactKeys) {
        const uint32_t k[2] = {__float_as_uint(k0), __float_as_uint(k1)};
        mma_tf32(state[n], hi, k);
        mma_tf32(correction[n], lo, k);
      } else {
        const Tf32Parts b0 = split_tf32(k0), b1 = split_tf32(k1);
        const uint32_t k_hi[2] = {b0.hi, b1.hi}, k_lo[2] = {b0.lo, b1.lo};
        mma_tf32(state[n], hi, k_hi);
        mma_tf32(correction[n], lo, k_hi);
        mma_tf32(correction[n], hi, k_lo);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      state[n][e] += correction[n][e];
    }
  }
}

// chunk_carry: the only sequential pass. Per chunk it reads W, U, K and the
// decays and does no more than the chain needs: v' = U - W S^T (written over
// U), the state at the chunk's start (ChunkScratch::h) for chunk_output, the
// checkpoints and the next state, for kCarryBlockRows rows of the state.
//
// The state never leaves the warps' registers: W S^T takes it as the right
// operand as it lies in the accumulators (the k indices t and t + 4 of a
// product are the columns 2t and 2t + 1 of a column tile, W's columns taken
// in the same order), each column group's part of the sum over Dk to shared
// memory, added up with U's; the update adds into the accumulators.
//
// Nothing of the chain waits for global memory: a chunk's W, K, U and
// decays are copied asynchronously into one of two stages while the chunk
// before is computed. K comes as the inputs give it, its qk_norm scales on
// v' instead: with float16 and bfloat16 inputs (kExactKeys) it is an exact
// operand of the update's products.
template <bool kExactKeys>
__device__ __forceinline__ void chunk_carry(
    const CoreArgs& a, const ChunkScratch& s) {
  extern __shared__ __align__(128) float shared[];
  // [kCarryColumnGroups][kChunk][kCarryPartialStride]: each column group's
  // W S^T over its columns; a checkpoint's left operand once they are read.
  float* partials = shared + 2 * kCarryStageFloats;
  // [kChunk][kCarryRowStride]: decay(L-1, j) v'_j / |k_j|, the update's left
  // operand.
  float* carried = partials + kCarryColumnGroups * kChunk * kCarryPartialStride;
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kCarryBlockRows;
  const int rows = min(kCarryBlockRows, dv - row0);
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunks = a.per_key_gates != 0
      ? (int64_t(b) * a.value_heads + h) * chunks
      : (int64_t(b) * a.key_heads + kh) * chunks;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, t = lane % 4;
  const int tile_row = warp / kCarryColumnGroups * kTile;
  const int group = warp % kCarryColumnGroups;
  const int column0 = group * kGroupColumns;

  // What the copies leave out is 0: W's and K's columns past tile_padded(Dk),
  // U's past tile_padded(Dv).
  for (int n = 0; n < 2; ++n) {
    const CarryStage stage = carry_stage(shared, n);
    for (int e = threadIdx.x; e < kChunk * kChunkedMaxDim;
         e += kChunkedThreads) {
      const int i = e / kChunkedMaxDim, c = e % kChunkedMaxDim;
      if (c >= kw) {
        stage.w[i * kCarryWStride + c] = 0.0f;
        stage.k[i * kCarryKStride + c] = 0.0f;
      }
    }
    for (int e = threadIdx.x; e < kChunk * kCarryBlockRows;
         e += kChunkedThreads) {
      const int i = e / kCarryBlockRows, c = e % kCarryBlockRows;
      if (row0 + c >= vw) {
        stage.u[i * kCarryRowStride + c] = 0.0f;
      }
    }
  }
  copy_chunk_async(
      s,
      chunk_place(a, 0).index,
      key_chunks,
      kw,
      vw,
      row0,
      carry_stage(shared, 0));
  __pipeline_commit();
  // Rows past Dv and columns past Dk are 0.
  float state[kColumnTiles][4];
#pragma unroll
  for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = tile_row + g + 8 * (e / 2);
      const int c = column0 + 8 * n + 2 * t + e % 2;
      state[n][e] = r < rows && c < dk
          ? a.state_in[head_state + int64_t(row0 + r) * dk + c]
          : 0.0f;
    }
  }

  int next_checkpoint = 0;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const ChunkPlace place = chunk_place(a, chunk);
    const CarryStage here = carry_stage(shared, chunk % 2);
    const float* from_start = here.decays;
    const float* to_end = here.decays + kChunk;
    const float* log_sum = here.decays + 2 * kChunk;
    const float* last_wipe = here.decays + 3 * kChunk;
    const float* key_scales = here.decays + 4 * kChunk;
    // This chunk's inputs have landed, and every warp is done with the chunk
    // before, whose stage the next chunk's copies take.
    __pipeline_wait_prior(0);
    __syncthreads();
    if (chunk + 1 < chunks) {
      copy_chunk_async(
          s,
          chunk_place(a, chunk + 1).index,
          key_chunks + chunk + 1,
          kw,
          vw,
          row0,
          carry_stage(shared, (chunk + 1) % 2));
      __pipeline_commit();
    }
    // The state at the chunk's start, for chunk_output.
    store_state(
        state,
        s.h + place.index * dv * dk + int64_t(row0) * dk,
        dk,
        rows,
        tile_row,
        column0);

    // W S^T over the group's columns, every token tile and both row halves
    // of the warp's rows: 3xTF32, the state split once.
    {
      Tf32Parts right[kColumnTiles][4];
#pragma unroll
      for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          right[n][e] = split_tf32(state[n][e]);
        }
      }
      float sums[kTokenTiles][2][4] = {}, corrections[kTokenTiles][2][4] = {};
#pragma unroll
      for (int n = 0; n < kColumnTiles; ++n) {
        const int c = column0 + 8 * n + 2 * t;
#pragma unroll
        for (int m = 0; m < kTokenTiles; ++m) {
          const float2 top = *reinterpret_cast<const float2*>(
              here.w + (kTile * m + g) * kCarryWStride + c);
          const float2 bottom = *reinterpret_cast<const float2*>(
              here.w + (kTile * m + g + 8) * kCarryWStride + c);
          const Tf32Parts a0 = split_tf32(top.x), a1 = split_tf32(bottom.x);
          const Tf32Parts a2 = split_tf32(top.y), a3 = split_tf32(bottom.y);
          const uint32_t hi[4] = {a0.hi, a1.hi, a2.hi, a3.hi};
          const uint32_t lo[4] = {a0.lo, a1.lo, a2.lo, a3.lo};
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t s_hi[2] = {
                right[n][2 * half].hi, right[n][2 * half + 1].hi};
            const uint32_t s_lo[2] = {
                right[n][2 * half].lo, right[n][2 * half + 1].lo};
            mma_tf32(sums[m][half], hi, s_hi);
            mma_tf32(corrections[m][half], lo, s_hi);
            mma_tf32(corrections[m][half], hi, s_lo);
          }
        }
      }
      float* mine = partials + group * kChunk * kCarryPartialStride;
#pragma unroll
      for (int m = 0; m < kTokenTiles; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float* x = sums[m][half];
          const float* y = corrections[m][half];
          const int i = kTile * m + g, r = tile_row + 8 * half + 2 * t;
          *reinterpret_cast<float2*>(mine + i * kCarryPartialStride + r) =
              make_float2(x[0] + y[0], x[1] + y[1]);
          *reinterpret_cast<float2*>(mine + (i + 8) * kCarryPartialStride + r) =
              make_float2(x[2] + y[2], x[3] + y[3]);
        }
      }
    }
    __syncthreads();
    // v' = U - W S^T, kept for chunk_output and the checkpoints, and the
    // update's left operand decay(L-1, j) v'_j / |k_j|: warp w the tokens
    // w, w + 8, ..., lane r the block's row r.
    for (int i = warp; i < kChunk; i += kChunkedThreads / kWarp) {
      float product = 0.0f;
#pragma unroll
      for (int q = 0; q < kCarryColumnGroups; ++q) {
        product += partials[(q * kChunk + i) * kCarryPartialStride + lane];
      }
      const float delta = here.u[i * kCarryRowStride + lane] - product;
      here.u[i * kCarryRowStride + lane] = delta;
      carried[i * kCarryRowStride + lane] = to_end[i] * key_scales[i] * delta;
      if (lane < rows) {
        s.u[(place.index * kChunk + i) * vw + row0 + lane] = delta;
      }
    }
    // The sanitizer probe (tools/cuda/sanitize.sh) builds without this barrier:
    // the update then reads v' scaled, and the checkpoints v', that other
    // warps may not have written yet.
#ifndef GD_SANITIZER_PROBE
    __syncthreads();
#endif

    // chunk_checkpoint: the state after the first i tokens of the chunk,
    // decay(i-1, -1) S + sum_{j < i} decay(i-1, j) v'_j k_j^T, for each
    // checkpoint in the chunk: the update with its left operand cut at i.
    while (next_checkpoint < a.checkpoint_count &&
           a.checkpoints[next_checkpoint] <= place.t0 + place.length) {
      const int i = a.checkpoints[next_checkpoint] - place.t0;
      float* cut = partials;
      // The partials, or the checkpoint before, have been read.
      __syncthreads();
      for (int j = warp; j < kChunk; j += kChunkedThreads / kWarp) {
        const float decay = j < i && !(last_wipe[i - 1] > float(j))
            ? expf(log_sum[i - 1] - log_sum[j])
            : 0.0f;
        cut[j * kCarryRowStride + lane] =
            decay * key_scales[j] * here.u[j * kCarryRowStride + lane];
      }
      __syncthreads();
      float at[kColumnTiles][4];
#pragma unroll
      for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          at[n][e] = from_start[i - 1] * state[n][e];
        }
      }
      add_update<kExactKeys>(at, cut, here.k, tile_row, column0);
      store_state(
          at,
          a.checkpoint_states +
              int64_t(next_checkpoint) * a.batch * a.value_heads * dv * dk +
              head_state + int64_t(row0) * dk,
          dk,
          rows,
          tile_row,
          column0);
      ++next_checkpoint;
    }

    // chunk_carry_state: S = decay(L-1, -1) S + sum_j decay(L-1, j) v'_j k_j^T,
    // each column c of S by its decay_c(L-1, -1) (one decay for every
    // column with scalar gates; with per-key gates K is decayed already).
#pragma unroll
    for (int n = 0; n < kColumnTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        state[n][e] *= here.column_decays[column0 + 8 * n + 2 * t + e % 2];
      }
    }
    add_update<kExactKeys>(state, carried, here.k, tile_row, column0);
  }
  store_state(
      state,
      a.state_out + head_state + int64_t(row0) * dk,
      dk,
      rows,
      tile_row,
      column0);
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_carry_<dtype>
// (the dtype of the inputs, whose K chunk_prepare kept in float32). One block
// a multiprocessor (its shared memory, kCarrySharedFloats).
#define GD_CHUNK_CARRY_ENTRY(type, suffix)                \
  extern "C" __global__ void __launch_bounds__(           \
      mlx_gated_delta::cuda::kChunkedThreads, 1)          \
      gd_chunk_carry_##suffix(                            \
          const mlx_gated_delta::cuda::CoreArgs a,        \
          const mlx_gated_delta::cuda::ChunkScratch s) {  \
    mlx_gated_delta::cuda::chunk_carry<                   \
        mlx_gated_delta::cuda::kExactInTf32<type>>(a, s); \
  }
GD_CHUNK_CARRY_ENTRY(float, f32)
GD_CHUNK_CARRY_ENTRY(__half, f16)
GD_CHUNK_CARRY_ENTRY(__nv_bfloat16, bf16)
