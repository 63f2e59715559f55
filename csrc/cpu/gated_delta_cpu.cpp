// Entry point of the CPU kernels: one (batch row, value head) problem per
// task of the thread pool.
#include "cpu/gated_delta_cpu.h"

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
  parallel_for(problems, [&](int problem) {
    const int batch = problem / p.value_heads;
    const int head = problem % p.value_heads;
    const HeadView<T> view = head_view(p, buffers, batch, head);
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
