// chunk_carry: the chunked form's sequential pass (chunked_common.cuh).
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// One chunk's W, U tile (kRows columns of U from row0; U's rows are
// tile_padded(Dv) wide and 0 past Dv, and the tile's columns past them are
// set to 0 here) and decays.
template <int kRows>
__device__ void copy_chunk_async(
    const ChunkScratch& s,
    int64_t index,
    int kw,
    int vw,
    int row0,
    float* ws,
    int kp,
    float* us,
    int rp,
    float* decays) {
  copy_rows_async(s.w + index * kChunk * kw, kw, kChunk, kw, ws, kp);
  for (int e = threadIdx.x; e < kChunk * kRows / 4; e += kChunkedThreads) {
    const int i = e / (kRows / 4), c = 4 * (e % (kRows / 4));
    if (row0 + c < vw) {
      __pipeline_memcpy_async(
          us + i * rp + c, s.u + (index * kChunk + i) * vw + row0 + c, 16);
    } else {
      *reinterpret_cast<float4*>(us + i * rp + c) = float4{0, 0, 0, 0};
    }
  }
  static_assert(
      kDecayRows * kChunk <= 4 * kChunkedThreads, "one decay vector a thread");
  if (4 * threadIdx.x < kDecayRows * kChunk) {
    __pipeline_memcpy_async(
        decays + 4 * threadIdx.x,
        s.decays + index * kDecayRows * kChunk + 4 * threadIdx.x,
        16);
  }
}

// chunk_carry: the only sequential pass. Per chunk it reads W, U, K and the
// decays and does no more than the chain needs: v' = U - W S^T (written over
// U), the state at the chunk's start (ChunkScratch::h) for chunk_output, the
// checkpoints and the next state, for kRows rows of the state (a multiple of
// 16). The products on tensor cores: v' with warp w the token tile w % 4 and
// half w / 4 of Dk (the halves added after), every row tile; the state update
// with warp w the state columns 16 w to 16 w + 15 of every row tile;
// chunk_checkpoint (FMA) state rows r = warp + 8 y and columns
// c = lane + 32 z.
//
// Nothing of the chain waits for global memory: the inputs are copied into
// shared memory asynchronously, each as soon as its buffer is free. The next
// chunk's W, U tile and decays (U and the decays double-buffered) from the
// end of W S^T, in flight during v' and the update; the next chunk's K (from
// chunk_prepare's scratch, once per key head) from the end of the update, in
// flight during the next W S^T and v'. K comes as the inputs give it, its
// qk_norm scales on v' instead: with float16 and bfloat16 inputs
// (kExactKeys) it is an exact operand of the update's products.
template <int kRows, bool kExactKeys>
__device__ __forceinline__ void chunk_carry(
    const CoreArgs& a, const ChunkScratch& s) {
  static_assert(kRows % kTile == 0, "whole row tiles");
  constexpr int kRowTiles = kRows / kTile;
  constexpr int kWarpRows = kRows / (kChunkedThreads / kWarp);
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), rp = tile_stride(kRows);
  float* state = shared;  // [kRows][kp]
  float* ws = state + kRows * kp;  // [kChunk][kp]: W
  float* ks = ws + kChunk * kp;  // [kChunk][kp]: K
  // [2][kChunk][rp]: U, then v', of even and odd chunks.
  float* u_buffers = ks + kChunk * kp;
  // [kChunk][rp]: W S^T over the first half of Dk, then
  // decay(L-1, j) v'_j / |k_j|, chunk_carry_state's left operand.
  float* carried = u_buffers + 2 * kChunk * rp;
  float* second_half = carried + kChunk * rp;  // [kChunk][rp]: the other half
  // [2][kDecayRows][kChunk]: the decays (ChunkScratch) of even and odd
  // chunks: from_start, to_end, the cumulative logs and last wipes of
  // chunk_checkpoint's decay(i - 1, j), and K's qk_norm scales.
  float* decay_buffers = second_half + kChunk * rp;

  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kRows;
  const int rows = min(kRows, dv - row0);
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunks = (int64_t(b) * a.key_heads + kh) * chunks;
  copy_chunk_async<kRows>(
      s,
      chunk_place(a, 0).index,
      kw,
      vw,
      row0,
      ws,
      kp,
      u_buffers,
      rp,
      decay_buffers);
  __pipeline_commit();
  copy_rows_async(s.k + key_chunks * kChunk * kw, kw, kChunk, kw, ks, kp);
  __pipeline_commit();
  // Rows past Dv and columns past Dk are 0 (tile padding).
  for (int e = threadIdx.x; e < kRows * kw; e += kChunkedThreads) {
    const int r = e / kw, c = e % kw;
    state[r * kp + c] = r < rows && c < dk
        ? a.state_in[head_state + int64_t(row0 + r) * dk + c]
        : 0.0f;
  }
  // The first chunk's W, U and decays have landed (its K may not have).
  __pipeline_wait_prior(1);
  __syncthreads();

  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int next_checkpoint = 0;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const ChunkPlace place = chunk_place(a, chunk);
    float* u = s.u + place.index * kChunk * vw + row0;
    float* deltas = u_buffers + (chunk % 2) * kChunk * rp;  // U, then v'
    const float* decays = decay_buffers + (chunk % 2) * kDecayRows * kChunk;
    const float* from_start = decays;
    const float* to_end = decays + kChunk;
    const float* log_sum = decays + 2 * kChunk;
    const float* last_wipe = decays + 3 * kChunk;
    const float* key_scales = decays + 4 * kChunk;
    // The state at the chunk's start, for chunk_output.
    float* h_out = s.h + place.index * dv * dk + int64_t(row0) * dk;
    for (int r = warp; r < rows; r += kChunkedThreads / kWarp) {
      for (int c = lane; c < dk; c += kWarp) {
        h_out[r * dk + c] = state[r * kp + c];
      }
    }

    // chunk_carry: W S^T, in two halves of Dk.
    {
      const int ti = warp % 4, half = warp / 4;
      Product products[kRowTiles];
      for (int c0 = half * kw / 2; c0 < (half + 1) * kw / 2; c0 += 8) {
        const Operand<OperandA<wmma::row_major>, false> w(
            ws + ti * kTile * kp + c0, kp);
#pragma unroll
        for (int tr = 0; tr < kRowTiles; ++tr) {
          const Operand<OperandB<wmma::col_major>, false> state_rows(
              state + tr * kTile * kp + c0, kp);
          products[tr].add(w, state_rows);
        }
      }
#pragma unroll
      for (int tr = 0; tr < kRowTiles; ++tr) {
        wmma::store_matrix_sync(
            (half == 0 ? carried : second_half) + ti * kTile * rp + tr * kTile,
            products[tr].finish(), rp, wmma::mem_row_major);
      }
    }
    __syncthreads();
    // W has been read, and the other U and decay buffers were last read by
    // the chunk before: the next chunk's copies start (an empty group after
    // the last chunk, so that the waits count the same).
    if (chunk + 1 < chunks) {
      copy_chunk_async<kRows>(
          s,
          chunk_place(a, chunk + 1).index,
          kw,
          vw,
          row0,
          ws,
          kp,
          u_buffers + ((chunk + 1) % 2) * kChunk * rp,
          rp,
          decay_buffers + ((chunk + 1) % 2) * kDecayRows * kChunk);
    }
    __pipeline_commit();
    // v' = U - W S^T, kept for chunk_output and the checkpoints, and
    // chunk_carry_state's operand decay(L-1, j) v'_j / |k_j|.
    for (int e = threadIdx.x; e < kChunk * kRows; e += kChunkedThreads) {
      const int i = e / kRows, r = e % kRows;
      const float delta =
          deltas[i * rp + r] - carried[i * rp + r] - second_half[i * rp + r];
      deltas[i * rp + r] = delta;
      carried[i * rp + r] = to_end[i] * key_scales[i] * delta;
      if (r < rows) {
        u[i * vw + r] = delta;
      }
    }
    // This chunk's K has landed.
    __pipeline_wait_prior(1);
    // The sanitizer probe (tools/cuda/sanitize.sh) builds without this barrier:
    // chunk_carry_state then reads rows of K, and v' scaled for the update,
    // that other threads may not have written yet.
#ifndef GD_SANITIZER_PROBE
    __syncthreads();
#endif

    // chunk_checkpoint: the state after the first i tokens of the chunk,
    // decay(i-1, -1) S + sum_{j < i} decay(i-1, j) v'_j k_j^T, for each
    // checkpoint in the chunk (chunk_carry_state's update cut at i).
    bool checkpointed = false;
    while (next_checkpoint < a.checkpoint_count &&
           a.checkpoints[next_checkpoint] <= place.t0 + place.length) {
      const int i = a.checkpoints[next_checkpoint] - place.t0;
      float* slot = a.checkpoint_states +
          int64_t(next_checkpoint) * a.batch * a.value_heads * dv * dk +
          head_state;
#pragma unroll
      for (int y = 0; y < kWarpRows; ++y) {
        const int r = warp + 8 * y;
        float acc[kColumnsPerLane];
#pragma unroll
        for (int z = 0; z < kColumnsPerLane; ++z) {
          const int c = lane + kWarp * z;
          acc[z] = c < dk ? from_start[i - 1] * state[r * kp + c] : 0.0f;
        }
        for (int j = 0; j < i; ++j) {
          const float decay = last_wipe[i - 1] > float(j)
              ? 0.0f
              : expf(log_sum[i - 1] - log_sum[j]);
          const float d = decay * key_scales[j] * deltas[j * rp + r];
#pragma unroll
          for (int z = 0; z < kColumnsPerLane; ++z) {
            const int c = lane + kWarp * z;
            acc[z] += d * (c < dk ? ks[j * kp + c] : 0.0f);
          }
        }
        if (r < rows) {
#pragma unroll
          for (int z = 0; z < kColumnsPerLane; ++z) {
            const int c = lane + kWarp * z;
            if (c < dk) {
              slot[int64_t(row0 + r) * dk + c] = acc[z];
            }
          }
        }
      }
      ++next_checkpoint;
      checkpointed = true;
    }
    // The checkpoints read every column of the state rows they own; the
    // update below rewrites columns by warp.
    if (checkpointed) {
      __syncthreads();
    }

    // chunk_carry_state: S = decay(L-1, -1) S + sum_j decay(L-1, j) v'_j k_j^T,
    // the state's columns [16 w, 16 w + 16) in warp w's accumulators.
    if (warp * kTile < kw) {
      const float last = from_start[place.length - 1];
      Product updates[kRowTiles];
#pragma unroll
      for (int tr = 0; tr < kRowTiles; ++tr) {
        wmma::load_matrix_sync(
            updates[tr].sum, state + tr * kTile * kp + warp * kTile, kp,
            wmma::mem_row_major);
#pragma unroll
        for (int e = 0; e < updates[tr].sum.num_elements; ++e) {
          updates[tr].sum.x[e] *= last;
        }
      }
      for (int j0 = 0; j0 < place.length; j0 += 8) {
        const Operand<OperandB<wmma::row_major>, kExactKeys> keys(
            ks + j0 * kp + warp * kTile, kp);
#pragma unroll
        for (int tr = 0; tr < kRowTiles; ++tr) {
          const Operand<OperandA<wmma::col_major>, false> deltas_scaled(
              carried + j0 * rp + tr * kTile, rp);
          updates[tr].add(deltas_scaled, keys);
        }
      }
#pragma unroll
      for (int tr = 0; tr < kRowTiles; ++tr) {
        wmma::store_matrix_sync(
            state + tr * kTile * kp + warp * kTile, updates[tr].finish(), kp,
            wmma::mem_row_major);
      }
    }
    // The next chunk's W, U and decays have landed; after the barrier the
    // state is updated and K has been read: the next chunk's K starts.
    __pipeline_wait_prior(0);
    __syncthreads();
    if (chunk + 1 < chunks) {
      copy_rows_async(
          s.k + (key_chunks + chunk + 1) * kChunk * kw, kw, kChunk, kw, ks, kp);
    }
    __pipeline_commit();
  }
  for (int e = threadIdx.x; e < kRows * dk; e += kChunkedThreads) {
    const int r = e / dk, c = e % dk;
    if (r < rows) {
      a.state_out[head_state + int64_t(row0 + r) * dk + c] = state[r * kp + c];
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry points the executor looks up by name: gd_chunk_carry_<dtype>
// (the dtype of the inputs, whose K chunk_prepare kept in float32). Up to 16
// rows a block, two blocks share a multiprocessor (at most 128 registers a
// thread).
#define GD_CHUNK_CARRY_ENTRY(type, suffix)                               \
  extern "C" __global__ void __launch_bounds__(                          \
      mlx_gated_delta::cuda::kChunkedThreads,                            \
      mlx_gated_delta::cuda::kCarryRows <= 16 ? 2 : 1)                   \
      gd_chunk_carry_##suffix(                                           \
          const mlx_gated_delta::cuda::CoreArgs a,                       \
          const mlx_gated_delta::cuda::ChunkScratch s) {                 \
    mlx_gated_delta::cuda::chunk_carry<                                  \
        mlx_gated_delta::cuda::kCarryRows,                               \
        mlx_gated_delta::cuda::kExactInTf32<type>>(a, s);                \
  }
GD_CHUNK_CARRY_ENTRY(float, f32)
GD_CHUNK_CARRY_ENTRY(__half, f16)
GD_CHUNK_CARRY_ENTRY(__nv_bfloat16, bf16)
