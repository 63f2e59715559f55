// chunk_carry: the chunked form's sequential pass (chunked_common.cuh).
#include "cuda/chunked_common.cuh"

namespace mlx_gated_delta::cuda {

namespace {

// One chunk's W, U tile (kCarryRows columns of U from row0; U's rows are
// tile_padded(Dv) wide and 0 past Dv, so the tile is whole) and decays.
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
  static_assert(
      kChunk * kCarryRows / 4 == kChunkedThreads, "one U vector a thread");
  {
    const int i = threadIdx.x / (kCarryRows / 4);
    const int c = 4 * (threadIdx.x % (kCarryRows / 4));
    __pipeline_memcpy_async(
        us + i * rp + c, s.u + (index * kChunk + i) * vw + row0 + c, 16);
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
// checkpoints and the next state. The products on tensor cores: v' with warp
// w the token tile w % 4 and half w / 4 of Dk (the halves added after), the
// state update with warp w the state columns 16 w to 16 w + 15;
// chunk_checkpoint (FMA) state rows r = warp + 8 y and columns
// c = lane + 32 z.
//
// Nothing of the chain waits for global memory: the inputs are copied into
// shared memory asynchronously, each as soon as its buffer is free. The next
// chunk's W, U tile and decays (U and the decays double-buffered) from the
// end of W S^T, in flight during v' and the update; the next chunk's K (from
// chunk_prepare's scratch, normalised there once per key head) from the end
// of the update, in flight during the next W S^T and v'.
__device__ __forceinline__ void chunk_carry(
    const CoreArgs& a, const ChunkScratch& s) {
  constexpr int kRowTiles = kCarryRows / 8;
  extern __shared__ __align__(128) float shared[];
  const int dk = a.key_dim, dv = a.value_dim;
  const int kw = tile_padded(dk), vw = tile_padded(dv);
  const int kp = tile_stride(dk), rp = tile_stride(kCarryRows);
  float* state = shared;  // [kCarryRows][kp]
  float* ws = state + kCarryRows * kp;  // [kChunk][kp]: W
  float* ks = ws + kChunk * kp;  // [kChunk][kp]: K
  // [2][kChunk][rp]: U, then v', of even and odd chunks.
  float* u_buffers = ks + kChunk * kp;
  // [kChunk][rp]: W S^T over the first half of Dk, then decay(L-1, j) v'_j,
  // chunk_carry_state's left operand.
  float* carried = u_buffers + 2 * kChunk * rp;
  float* second_half = carried + kChunk * rp;  // [kChunk][rp]: the other half
  // [2][kDecayRows][kChunk]: the decays (ChunkScratch) of even and odd
  // chunks: from_start, to_end, then the cumulative logs and last wipes of
  // chunk_checkpoint's decay(i - 1, j).
  float* decay_buffers = second_half + kChunk * rp;

  const int b = blockIdx.z, h = blockIdx.y;
  const int row0 = blockIdx.x * kCarryRows;
  const int rows = min(kCarryRows, dv - row0);
  const int kh = key_head_of(a, h);
  const int64_t head_state = (int64_t(b) * a.value_heads + h) * dv * dk;
  const int chunks = (a.tokens + kChunk - 1) / kChunk;
  const int64_t key_chunks = (int64_t(b) * a.key_heads + kh) * chunks;
  copy_chunk_async(
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
  for (int e = threadIdx.x; e < kCarryRows * kw; e += kChunkedThreads) {
    const int r = e / kw, c = e % kw;
    state[r * kp + c] = r < rows && c < dk
        ? a.state_in[head_state + int64_t(row0 + r) * dk + c]
        : 0.0f;
  }

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
    // This chunk's W, U and decays have landed (its K may not have).
    __pipeline_wait_prior(1);
    __syncthreads();
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
      Product product;
      for (int c0 = half * kw / 2; c0 < (half + 1) * kw / 2; c0 += 8) {
        product.add<wmma::row_major, wmma::col_major>(
            ws + ti * kTile * kp + c0, kp, state + c0, kp);
      }
      wmma::store_matrix_sync(
          (half == 0 ? carried : second_half) + ti * kTile * rp,
          product.finish(), rp, wmma::mem_row_major);
    }
    __syncthreads();
    // W has been read, and the other U and decay buffers were last read by
    // the chunk before: the next chunk's copies start (an empty group after
    // the last chunk, so that the waits count the same).
    if (chunk + 1 < chunks) {
      copy_chunk_async(
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
    // chunk_carry_state's operand decay(L-1, j) v'_j.
    for (int e = threadIdx.x; e < kChunk * kCarryRows; e += kChunkedThreads) {
      const int i = e / kCarryRows, r = e % kCarryRows;
      const float delta =
          deltas[i * rp + r] - carried[i * rp + r] - second_half[i * rp + r];
      deltas[i * rp + r] = delta;
      carried[i * rp + r] = to_end[i] * delta;
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
      for (int y = 0; y < kRowTiles; ++y) {
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
          const float d = decay * deltas[j * rp + r];
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
    // the state's columns [16 w, 16 w + 16) in warp w's accumulator.
    if (warp * kTile < kw) {
      float* tile = state + warp * kTile;
      Product update;
      wmma::load_matrix_sync(update.sum, tile, kp, wmma::mem_row_major);
      const float last = from_start[place.length - 1];
#pragma unroll
      for (int e = 0; e < update.sum.num_elements; ++e) {
        update.sum.x[e] *= last;
      }
      for (int j0 = 0; j0 < place.length; j0 += 8) {
        update.add<wmma::col_major, wmma::row_major>(
            carried + j0 * rp, rp, ks + j0 * kp + warp * kTile, kp);
      }
      wmma::store_matrix_sync(tile, update.finish(), kp, wmma::mem_row_major);
    }
    __syncthreads();
    // K has been read: the next chunk's K starts.
    if (chunk + 1 < chunks) {
      copy_rows_async(
          s.k + (key_chunks + chunk + 1) * kChunk * kw, kw, kChunk, kw, ks, kp);
    }
    __pipeline_commit();
  }
  for (int e = threadIdx.x; e < kCarryRows * dk; e += kChunkedThreads) {
    const int r = e / dk, c = e % dk;
    if (r < rows) {
      a.state_out[head_state + int64_t(row0 + r) * dk + c] = state[r * kp + c];
    }
  }
}

}  // namespace

}  // namespace mlx_gated_delta::cuda

// The entry point the executor looks up by name (it reads only float32
// scratch, so one for every dtype).
extern "C" __global__ void __launch_bounds__(
    mlx_gated_delta::cuda::kChunkedThreads, 2)
    gd_chunk_carry(
        const mlx_gated_delta::cuda::CoreArgs a,
        const mlx_gated_delta::cuda::ChunkScratch s) {
  mlx_gated_delta::cuda::chunk_carry(a, s);
}
