// The choice of the CPU kernels' level, and the entry points that call the
// chosen copy (kernel_level.h). Compiled once, for the baseline, like the rest
// of the module outside the kernels.
#include "cpu/kernel_level.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/backward.h"
#include "cpu/forward.h"
#include "cpu/segment.h"
#include "mlx/types/half_types.h"
#include "projection/projection_cpu.h"

// The declarations of each copy this build holds; CMakeLists.txt defines
// MLX_GATED_DELTA_NATIVE_KERNELS or MLX_GATED_DELTA_X86_KERNEL_LEVELS to say
// which (neither: the baseline copy alone).
#if defined(MLX_GATED_DELTA_NATIVE_KERNELS)
#define MLX_GATED_DELTA_KERNEL_LEVEL native
#include "cpu/kernel_entry_points.h"
#undef MLX_GATED_DELTA_KERNEL_LEVEL
#else
#define MLX_GATED_DELTA_KERNEL_LEVEL baseline
#include "cpu/kernel_entry_points.h"
#undef MLX_GATED_DELTA_KERNEL_LEVEL
#if defined(MLX_GATED_DELTA_X86_KERNEL_LEVELS)
#define MLX_GATED_DELTA_KERNEL_LEVEL x86_64_v3
#include "cpu/kernel_entry_points.h"
#undef MLX_GATED_DELTA_KERNEL_LEVEL
#define MLX_GATED_DELTA_KERNEL_LEVEL x86_64_v4
#include "cpu/kernel_entry_points.h"
#undef MLX_GATED_DELTA_KERNEL_LEVEL
#endif
#endif

namespace mlx_gated_delta::cpu {

namespace {

// The levels this build holds, lowest first.
constexpr KernelLevel kBuiltLevels[] = {
#if defined(MLX_GATED_DELTA_NATIVE_KERNELS)
    KernelLevel::Native,
#else
    KernelLevel::Baseline,
#if defined(MLX_GATED_DELTA_X86_KERNEL_LEVELS)
    KernelLevel::X86_64_V3,
    KernelLevel::X86_64_V4,
#endif
#endif
};

// Whether this CPU (and the OS, which must save the wider registers) runs a
// level's instructions. x86-64-v3 also has F16C, LZCNT and MOVBE, which every
// CPU with AVX2, FMA and BMI2 has too.
bool cpu_runs(KernelLevel level) {
#if defined(MLX_GATED_DELTA_X86_KERNEL_LEVELS)
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
      __builtin_cpu_supports("bmi2");
  switch (level) {
    case KernelLevel::X86_64_V3:
      return v3;
    case KernelLevel::X86_64_V4:
      return v3 && __builtin_cpu_supports("avx512f") &&
          __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512cd");
    default:
      return true;
  }
#else
  (void)level;
  return true;
#endif
}

KernelLevel choose_kernel_level() {
  const std::vector<KernelLevel> runnable = runnable_kernel_levels();
  const char* requested = std::getenv("MLX_GATED_DELTA_CPU_LEVEL");
  if (requested == nullptr || *requested == '\0') {
    return runnable.back();
  }
  for (KernelLevel level : runnable) {
    if (std::strcmp(requested, kernel_level_name(level)) == 0) {
      return level;
    }
  }
  std::fprintf(
      stderr,
      "mlx_gated_delta: MLX_GATED_DELTA_CPU_LEVEL=%s is not a level this "
      "build holds and this CPU runs; using %s\n",
      requested,
      kernel_level_name(runnable.back()));
  return runnable.back();
}

}  // namespace

const char* kernel_level_name(KernelLevel level) {
  switch (level) {
    case KernelLevel::Native:
      return "native";
    case KernelLevel::Baseline:
      return "baseline";
    case KernelLevel::X86_64_V3:
      return "x86_64_v3";
    case KernelLevel::X86_64_V4:
      return "x86_64_v4";
  }
  return "unknown";
}

std::vector<KernelLevel> runnable_kernel_levels() {
  std::vector<KernelLevel> levels;
  for (KernelLevel level : kBuiltLevels) {
    if (cpu_runs(level)) {
      levels.push_back(level);
    }
  }
  return levels;
}

KernelLevel kernel_level() {
  static const KernelLevel chosen = choose_kernel_level();
  return chosen;
}

// `return <the chosen level's namespace>::call;`
#if defined(MLX_GATED_DELTA_NATIVE_KERNELS)
#define CALL_CHOSEN_LEVEL(call) return native::call
#elif defined(MLX_GATED_DELTA_X86_KERNEL_LEVELS)
#define CALL_CHOSEN_LEVEL(call)  \
  switch (kernel_level()) {      \
    case KernelLevel::X86_64_V4: \
      return x86_64_v4::call;    \
    case KernelLevel::X86_64_V3: \
      return x86_64_v3::call;    \
    default:                     \
      return baseline::call;     \
  }
#else
#define CALL_CHOSEN_LEVEL(call) return baseline::call
#endif

template <typename T>
void gated_delta_forward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const CoreBuffers<T>& buffers) {
  CALL_CHOSEN_LEVEL(gated_delta_forward<T>(params, algorithm, buffers));
}

ChunkedTrace trace_chunked_stages(
    const GatedDeltaParams& params,
    const CoreBuffers<float>& buffers,
    int batch,
    int head) {
  CALL_CHOSEN_LEVEL(trace_chunked_stages(params, buffers, batch, head));
}

ChunkedBackwardTrace trace_chunked_backward_stages(
    const GatedDeltaParams& params,
    const BackwardBuffers<float>& buffers,
    int batch,
    int head) {
  CALL_CHOSEN_LEVEL(
      trace_chunked_backward_stages(params, buffers, batch, head));
}

template <typename T>
void gated_delta_backward(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const BackwardBuffers<T>& buffers) {
  CALL_CHOSEN_LEVEL(gated_delta_backward<T>(params, algorithm, buffers));
}

template <typename T>
void gated_delta_segment_forward(
    const SegmentParams& params,
    Algorithm algorithm,
    const SegmentBuffers<T>& buffers) {
  CALL_CHOSEN_LEVEL(gated_delta_segment_forward<T>(params, algorithm, buffers));
}

template <typename T>
void gated_delta_segment_backward(
    const SegmentParams& params,
    Algorithm forward,
    Algorithm backward,
    const SegmentBackwardBuffers<T>& buffers) {
  CALL_CHOSEN_LEVEL(
      gated_delta_segment_backward<T>(params, forward, backward, buffers));
}

template <typename T>
void dense_projection_forward(
    int64_t rows,
    int in_features,
    int out_features,
    MatrixView<T> x,
    MatrixView<T> weight,
    T* y,
    int64_t y_row_stride) {
  CALL_CHOSEN_LEVEL(dense_projection_forward<T>(
      rows, in_features, out_features, x, weight, y, y_row_stride));
}

#define INSTANTIATE_ENTRY_POINTS(T)                                   \
  template void gated_delta_forward<T>(                               \
      const GatedDeltaParams&, Algorithm, const CoreBuffers<T>&);     \
  template void gated_delta_backward<T>(                              \
      const GatedDeltaParams&, Algorithm, const BackwardBuffers<T>&); \
  template void gated_delta_segment_forward<T>(                       \
      const SegmentParams&, Algorithm, const SegmentBuffers<T>&);     \
  template void gated_delta_segment_backward<T>(                      \
      const SegmentParams&,                                           \
      Algorithm,                                                      \
      Algorithm,                                                      \
      const SegmentBackwardBuffers<T>&);                              \
  template void dense_projection_forward<T>(                          \
      int64_t, int, int, MatrixView<T>, MatrixView<T>, T*, int64_t);

INSTANTIATE_ENTRY_POINTS(float)
INSTANTIATE_ENTRY_POINTS(mlx::core::float16_t)
INSTANTIATE_ENTRY_POINTS(mlx::core::bfloat16_t)

}  // namespace mlx_gated_delta::cpu
