// Which compiled copy of the CPU kernels runs (docs/cpu.md).
//
// The kernels are compiled once per instruction-set level (CMakeLists.txt),
// each copy in its own namespace, mlx_gated_delta::cpu::<level>. The entry
// points in namespace mlx_gated_delta::cpu (forward.h, backward.h, segment.h,
// projection_cpu.h) call the copy of the level chosen here, once per process.
#pragma once

#include <string>
#include <vector>

namespace mlx_gated_delta::cpu {

enum class KernelLevel {
  Native,  // the only copy of a build for the host CPU (-march=native)
  Baseline,  // the compiler's default target: runs on every CPU of the arch
  X86_64_V3,  // AVX2, FMA, BMI2
  X86_64_V4,  // x86-64-v3 and AVX-512 (F, BW, DQ, VL, CD)
};

// "native", "baseline", "x86_64_v3", "x86_64_v4": the namespace of the copy,
// and what MLX_GATED_DELTA_CPU_LEVEL names.
const char* kernel_level_name(KernelLevel level);

// The levels this build holds that this CPU runs, lowest first.
std::vector<KernelLevel> runnable_kernel_levels();

// The level the kernels run at, decided on the first call: the one
// MLX_GATED_DELTA_CPU_LEVEL names where it names a runnable level (any other
// value is ignored, with a line on stderr), else the highest runnable one.
KernelLevel kernel_level();

}  // namespace mlx_gated_delta::cpu
