// Entry point of the CPU kernels: one (batch row, value head) problem per
// task of the thread pool.
#include "cpu/gated_delta_cpu.h"

#include <cstring>

#include "cpu/kernel_common.h"
#include "cpu/thread_pool.h"

namespace mlx_gated_delta::cpu {

using mlx::core::bfloat16_t;
using mlx::core::float16_t;

template <typename T>
void gated_delta_forward(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    const CoreBuffers<T>& buffers) {
  const int problems = p.batch * p.value_heads;
  const int64_t state_size = int64_t(p.value_dim) * p.key_dim;
  parallel_for(problems, [&](int problem) {
    const int batch = problem / p.value_heads;
    const int head = problem % p.value_heads;
    const HeadView<T> view = head_view(p, buffers, batch, head);
    if (buffers.state_in) {
      std::memcpy(
          view.state,
          buffers.state_in + int64_t(problem) * state_size,
          state_size * sizeof(float));
    } else {
      std::memset(view.state, 0, state_size * sizeof(float));
    }
    if (algorithm == Algorithm::Chunked) {
      chunked_head(p, view);
    } else {
      recurrent_head(p, view);
    }
  });
}

template void gated_delta_forward<float>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<float>&);
template void gated_delta_forward<float16_t>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<float16_t>&);
template void gated_delta_forward<bfloat16_t>(
    const GatedDeltaParams&, Algorithm, const CoreBuffers<bfloat16_t>&);

}  // namespace mlx_gated_delta::cpu
