// Entry point of the CPU kernels: independent (batch row, head) problems
// spread over the thread pool.
#include "cpu/forward.h"

#include "core/dispatch.h"
#include "cpu/kernel_common.h"
#include "cpu/thread_pool.h"

#include <vector>

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

using mlx::core::bfloat16_t;
using mlx::core::float16_t;

template <typename T>
void gated_delta_forward(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const CoreBuffers<T>& buffers) {
  if (algorithm == Algorithm::Recurrent) {
    // Each token does about four multiply-adds per state element (the
    // prediction, the decay, the update, the readout).
    const int64_t head_work = 4 * int64_t(p.tokens) * p.key_dim * p.value_dim;
    parallel_for(p.batch * p.value_heads, head_work, [&](int problem) {
      const int batch = problem / p.value_heads;
      const int head = problem % p.value_heads;
      recurrent_head(p, head_view(p, buffers, batch, head));
    });
    return;
  }
  // Chunked: one task per (batch row, key head) with the value heads that
  // read it, or one per value head (cpu_value_heads_per_task decides).
  const int heads_per_task = cpu_value_heads_per_task(p, thread_count());
  const bool group_heads = heads_per_task > 1;
  const int tasks = p.batch * p.value_heads / heads_per_task;
  parallel_for(tasks, [&](int task) {
    const int batch = task / (p.value_heads / heads_per_task);
    const int group = task % (p.value_heads / heads_per_task);
    std::vector<HeadView<T>> heads;
    for (int n = 0; n < heads_per_task; ++n) {
      // Group g holds the value heads of key head g.
      const int head = group_heads ? p.value_head_of(group, n) : group;
      heads.push_back(head_view(p, buffers, batch, head));
    }
    chunked_heads(p, heads.data(), heads_per_task);
  });
}

template void gated_delta_forward<float>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<float>&);
template void gated_delta_forward<float16_t>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<float16_t>&);
template void gated_delta_forward<bfloat16_t>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
