// gate_cumsum: per chunk of one (batch, value head), the inclusive cumsum of
// the log decays, the wipe mask (bit i: exp(g_i) == 0, gamma == 0 or a decay
// below float32's range) and beta, with masked tokens turned into no-ops
// (g = 0, beta = 0). Every later stage derives its decays from these three
// through chunk_decay() or channel_decay(). Per-key gates: the cumsum per key
// channel ([B, Hv, C*64, Dk]) and one mask per chunk and key channel ([B, Hv,
// C, Dk]: 8 bytes a chunk instead of a wipe position per token), beta once
// per token. In the chunked backward's rerun it also records the chunk's
// tiny decays (below float32's smallest normal number, a wipe included) per
// gate channel, which every backward stage tests (chunk_decays_normal).

#include "gated_delta_common.h"

// One thread per (batch, value head, chunk, gate channel): a 64-step serial
// scan. Scalar gates have one channel.
[[kernel]] void gated_delta_gate_cumsum(
    const device float* g [[buffer(0)]],
    const device float* beta [[buffer(1)]],
    const device bool* mask [[buffer(2)]],
    device float* gate_cumsum [[buffer(3)]],
    device ulong* wipe_mask [[buffer(4)]],
    device float* beta_effective [[buffer(5)]],
    constant GatedDeltaKernelParams& p [[buffer(6)]],
    device ulong* tiny_decay_mask [[buffer(7)]],
    uint index [[thread_position_in_grid]]) {
  const uint width = gate_width(p);
  const uint scans = p.batch * p.value_heads * p.num_chunks * width;
  if (index >= scans) {
    return;
  }
  const uint channel = index % width;
  const uint sequence = index / width;
  const uint chunk = sequence % p.num_chunks;
  const uint h = (sequence / p.num_chunks) % p.value_heads;
  const uint b = sequence / (p.num_chunks * p.value_heads);
  const uint first = chunk_row(p, b, h, p.value_heads, chunk);
  const uint length = chunk_length(p, chunk);
  float cumsum = 0.0f;
  ulong wipes = 0ul;
  ulong tiny_decays = 0ul;
  for (uint i = 0; i < kChunkSize; ++i) {
    float g_i = 0.0f;
    float beta_i = 0.0f;
    const uint t = chunk * kChunkSize + i;
    if (i < length && !token_is_masked(p, mask, b, t)) {
      g_i = g[gate_offset(p, b, t, h) * width + channel];
      beta_i = beta[gate_offset(p, b, t, h)];
    }
    // A wipe is a step whose decay is 0 in float32: g = -inf, and a g so
    // negative that exp(g) underflows (as on the CPU). It is recorded by
    // position and kept out of the sum, so no later difference of cumsums is
    // inf - inf, and a channel's sum stays as small as its surviving steps:
    // a -300 step would otherwise leave the later differences of that
    // channel's sums rounding at the size of 300.
    const float decay = exp(g_i);
    if (decay == 0.0f) {
      wipes |= 1ul << i;
    } else {
      cumsum += g_i;
    }
    if (!(decay >= kSmallestNormalFloat)) {
      tiny_decays |= 1ul << i;
    }
    gate_cumsum[(first + i) * width + channel] = cumsum;
    // Beta has one column: the scan of channel 0 writes it.
    if (channel == 0) {
      beta_effective[first + i] = beta_i;
    }
  }
  // Both masks hold a word per chunk and gate channel.
  const uint word = first / kChunkSize * width + channel;
  wipe_mask[word] = wipes;
  if (p.recurrent_wipe_chunks_only != 0) {
    tiny_decay_mask[word] = tiny_decays;
  }
}
