// gate_cumsum: per chunk of one (batch, value head), the inclusive cumsum of
// the log decays, the last wipe (g == -inf, from gamma == 0) and beta, with
// masked tokens turned into no-ops (g = 0, beta = 0). Every later stage
// derives its decays from these three through chunk_decay().

#include "gated_delta_common.h"

// One thread per (batch, value head, chunk): a 64-step serial scan.
[[kernel]] void gated_delta_gate_cumsum(
    const device float* g [[buffer(0)]],
    const device float* beta [[buffer(1)]],
    const device bool* mask [[buffer(2)]],
    device float* gate_cumsum [[buffer(3)]],
    device int* last_wipe [[buffer(4)]],
    device float* beta_effective [[buffer(5)]],
    constant GatedDeltaKernelParams& p [[buffer(6)]],
    uint index [[thread_position_in_grid]]) {
  const uint sequences = p.batch * p.value_heads * p.num_chunks;
  if (index >= sequences) {
    return;
  }
  const uint chunk = index % p.num_chunks;
  const uint h = (index / p.num_chunks) % p.value_heads;
  const uint b = index / (p.num_chunks * p.value_heads);
  const uint first = chunk_row(p, b, h, p.value_heads, chunk);
  const uint length = chunk_length(p, chunk);
  float cumsum = 0.0f;
  int wipe = -1;
  for (uint i = 0; i < kChunkSize; ++i) {
    float g_i = 0.0f;
    float beta_i = 0.0f;
    const uint t = chunk * kChunkSize + i;
    if (i < length && !token_is_masked(p, mask, b, t)) {
      g_i = g[gate_offset(p, b, t, h)];
      beta_i = beta[gate_offset(p, b, t, h)];
    }
    // Only finite decays enter the sum: a wipe is recorded by position, so
    // no later difference of cumsums is ever inf - inf.
    if (isinf(g_i) && g_i < 0.0f) {
      wipe = int(i);
    } else {
      cumsum += g_i;
    }
    gate_cumsum[first + i] = cumsum;
    last_wipe[first + i] = wipe;
    beta_effective[first + i] = beta_i;
  }
}
