// The segment's waves of key heads (segment.h), compiled once for every
// kernel level.
#include <algorithm>
#include <atomic>

#include "cpu/segment.h"

namespace mlx_gated_delta::cpu {

namespace {

std::atomic<int64_t> wave_bytes{kSegmentWaveBytes};

}  // namespace

int segment_wave_key_heads(const SegmentParams& p, int threads) {
  if (p.head_mapping != HeadMapping::Grouped) {
    return p.key_heads;
  }
  const int ratio = p.value_heads / p.key_heads;
  const int64_t per_key_head = int64_t(p.batch) * p.tokens *
      (2 * p.key_dim + 2 * ratio * p.value_dim) * int64_t(sizeof(float));
  const int64_t fitting = wave_bytes.load(std::memory_order_relaxed) /
      std::max<int64_t>(1, per_key_head);
  // The fewest key heads a wave takes: one (batch row, key head) task per
  // thread, so that the core runs each key head's value heads in one task
  // and normalises its q and k and builds its grams once
  // (cpu_value_heads_per_task), not once per value head. An empty batch
  // (B = 0) is one wave of nothing.
  const int rows = std::max(1, p.batch);
  const int per_thread = (threads + rows - 1) / rows;
  const int most = int(std::min<int64_t>(
      p.key_heads, std::max<int64_t>({1, per_thread, fitting})));
  // As many waves as `most` key heads a wave need, of even sizes.
  const int waves = (p.key_heads + most - 1) / most;
  return (p.key_heads + waves - 1) / waves;
}

int64_t exchange_segment_wave_bytes(int64_t bytes) {
  return wave_bytes.exchange(bytes);
}

}  // namespace mlx_gated_delta::cpu
