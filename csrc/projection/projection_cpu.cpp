#include "projection/projection_cpu.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/kernel_common.h"
#include "cpu/small_gemm.h"
#include "cpu/thread_pool.h"
#include "mlx/types/half_types.h"

namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL {

using mlx::core::bfloat16_t;
using mlx::core::float16_t;

namespace {

// A block of W^T (kBlockIn x kBlockOut floats, 128 KiB) stays in L2 while
// every row of x streams past it.
constexpr int kBlockOut = 128;
constexpr int kBlockIn = 256;

// With few rows (decode) the product is bound by reading W once: each row of
// W is widened into an L1 buffer and dotted with every row of x, with no
// packing. From this many rows on, the blocked GEMM's reuse wins.
constexpr int64_t kGemmMinRows = 48;

// Widens n values to float32. bfloat16 is the high half of a float32, so a
// shift of its bits widens it exactly, and unlike the element type's
// conversion operator this loop vectorizes (decode reads all of W this way).
template <typename T>
inline void widen(const T* src, int n, float* dst) {
  if constexpr (std::is_same_v<T, bfloat16_t>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int i = 0; i < n; ++i) {
      dst[i] = std::bit_cast<float>(uint32_t(bits[i]) << 16);
    }
  } else {
    for (int i = 0; i < n; ++i) {
      dst[i] = static_cast<float>(src[i]);
    }
  }
}

// Widens row r of `m` (in_features values) into `dst`.
template <typename T>
inline void widen_row(MatrixView<T> m, int64_t r, int in_features, float* dst) {
  const T* row = m.data + r * m.row_stride;
  if (m.column_stride == 1) {
    widen(row, in_features, dst);
    return;
  }
  for (int i = 0; i < in_features; ++i) {
    dst[i] = static_cast<float>(row[int64_t(i) * m.column_stride]);
  }
}

// `m` ([rows, in_features], any strides) in float32, row-major.
template <typename T>
std::vector<float> widen_rows(int64_t rows, int in_features, MatrixView<T> m) {
  std::vector<float> out(rows * in_features);
  for (int64_t r = 0; r < rows; ++r) {
    widen_row(m, r, in_features, out.data() + r * in_features);
  }
  return out;
}

// W's rows that dense_projection_by_dots dots side by side.
constexpr int kDotRows = 4;

template <typename T>
void dense_projection_by_dots(
    int64_t rows,
    int in_features,
    int out_features,
    const float* x,
    MatrixView<T> weight,
    T* y,
    int64_t y_row_stride) {
  constexpr int kRowsPerTask = 64;
  const int tasks = (out_features + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t task_work = rows * kRowsPerTask * in_features;
  // A float32 W with contiguous rows is read where it lies.
  const bool in_place = std::is_same_v<T, float> && weight.column_stride == 1;
  parallel_for(tasks, task_work, [&](int task) {
    std::vector<float> w_rows(in_place ? 0 : kDotRows * in_features);
    const int out_end = std::min(out_features, (task + 1) * kRowsPerTask);
    for (int o = task * kRowsPerTask; o < out_end; o += kDotRows) {
      const int n = std::min(kDotRows, out_end - o);
      const float* w = w_rows.data();
      int64_t ldw = in_features;
      if constexpr (std::is_same_v<T, float>) {
        if (in_place) {
          w = weight.data + o * weight.row_stride;
          ldw = weight.row_stride;
        }
      }
      if (!in_place) {
        for (int k = 0; k < n; ++k) {
          widen_row(weight, o + k, in_features, &w_rows[k * in_features]);
        }
      }
      // Each output element is dot(x row, W row), its lanes and order fixed:
      // it does not depend on how many rows come with it, nor on where the
      // buffers lie.
      for (int64_t r = 0; r < rows; ++r) {
        const float* x_r = x + r * in_features;
        float out[kDotRows];
        if (n == kDotRows) {
          dots<kDotRows>(w, ldw, x_r, in_features, out);
        } else {
          for (int k = 0; k < n; ++k) {
            dots<1>(w + k * ldw, ldw, x_r, in_features, out + k);
          }
        }
        for (int k = 0; k < n; ++k) {
          y[r * y_row_stride + o + k] = static_cast<T>(out[k]);
        }
      }
    }
  });
}

// x in float32, read by every block of W. A row-major x, or the transpose of
// a row-major matrix (the vjp's dy^T), is widened in its own memory order and
// read through `view`'s strides; any other layout is gathered row-major.
template <typename T>
std::vector<float> widen_x(
    int64_t rows, int in_features, MatrixView<T> x, MatrixA& view) {
  const bool row_major = x.column_stride == 1 && x.row_stride == in_features;
  const bool transposed = x.row_stride == 1 && x.column_stride == rows;
  if (!row_major && !transposed) {
    std::vector<float> x_f32 = widen_rows(rows, in_features, x);
    view = {x_f32.data(), in_features, 1};
    return x_f32;
  }
  std::vector<float> x_f32(rows * in_features);
  std::transform(x.data, x.data + x_f32.size(), x_f32.begin(), [](T v) {
    return static_cast<float>(v);
  });
  view = {x_f32.data(), x.row_stride, x.column_stride};
  return x_f32;
}

// The blocked GEMM: y[r, o] = sum_i x[r, i] weight[o, i], y's element (r, o)
// at y[r * y_row_stride + o * y_column_stride]. x is widened to float32 whole
// (rows x in floats); each block of kBlockOut rows of W is packed.
template <typename T>
void blocked_product(
    int64_t rows,
    int in_features,
    int out_features,
    MatrixView<T> x,
    MatrixView<T> weight,
    T* y,
    int64_t y_row_stride,
    int64_t y_column_stride) {
  MatrixA x_view{};
  const std::vector<float> x_f32 = widen_x(rows, in_features, x, x_view);
  const int out_blocks = (out_features + kBlockOut - 1) / kBlockOut;
  const int64_t block_work = rows * kBlockOut * in_features;
  parallel_for(out_blocks, block_work, [&](int block) {
    const int out_start = block * kBlockOut;
    const int out_size = std::min(kBlockOut, out_features - out_start);
    std::vector<float> packed(int64_t(kBlockIn) * out_size);
    std::vector<float> acc(rows * out_size, 0.0f);
    for (int in_start = 0; in_start < in_features; in_start += kBlockIn) {
      const int in_size = std::min(kBlockIn, in_features - in_start);
      // Pack W[out block, in block] transposed: the GEMM's B is [in, out].
      // The loop runs along W's contiguous axis.
      const T* w_block = weight.data + int64_t(out_start) * weight.row_stride +
          int64_t(in_start) * weight.column_stride;
      if (weight.column_stride == 1) {
        for (int o = 0; o < out_size; ++o) {
          const T* w_row = w_block + int64_t(o) * weight.row_stride;
          for (int i = 0; i < in_size; ++i) {
            packed[int64_t(i) * out_size + o] = static_cast<float>(w_row[i]);
          }
        }
      } else {
        for (int i = 0; i < in_size; ++i) {
          const T* w_column = w_block + int64_t(i) * weight.column_stride;
          for (int o = 0; o < out_size; ++o) {
            packed[int64_t(i) * out_size + o] =
                static_cast<float>(w_column[int64_t(o) * weight.row_stride]);
          }
        }
      }
      gemm(
          int(rows),
          out_size,
          in_size,
          1.0f,
          MatrixA{
              x_view.data + int64_t(in_start) * x_view.k_stride,
              x_view.row_stride,
              x_view.k_stride},
          packed.data(),
          out_size,
          acc.data(),
          out_size);
    }
    T* y_block = y + int64_t(out_start) * y_column_stride;
    if (y_column_stride == 1) {
      for (int64_t r = 0; r < rows; ++r) {
        T* y_row = y_block + r * y_row_stride;
        const float* acc_row = acc.data() + r * out_size;
        for (int o = 0; o < out_size; ++o) {
          y_row[o] = static_cast<T>(acc_row[o]);
        }
      }
    } else {  // y transposed: store along its contiguous axis
      for (int o = 0; o < out_size; ++o) {
        T* y_column = y_block + int64_t(o) * y_column_stride;
        for (int64_t r = 0; r < rows; ++r) {
          y_column[r * y_row_stride] = static_cast<T>(acc[r * out_size + o]);
        }
      }
    }
  });
}

}  // namespace

template <typename T>
void dense_projection_forward(
    int64_t rows,
    int in_features,
    int out_features,
    MatrixView<T> x,
    MatrixView<T> weight,
    T* y,
    int64_t y_row_stride) {
  if (rows < kGemmMinRows) {
    // The dot products read x row-major: widened straight into that order.
    const std::vector<float> x_rows = widen_rows(rows, in_features, x);
    dense_projection_by_dots(
        rows,
        in_features,
        out_features,
        x_rows.data(),
        weight,
        y,
        y_row_stride);
    return;
  }
  // The GEMM widens its x operand to float32 whole: with more rows than W
  // has, it computes y^T = W x^T instead, widening W (the input projection's
  // dx and dW at T = 8192 would widen 386 MiB, W 97 and 64 MiB; a W of a few
  // rows, as Qwen3.5's b and a, would widen all of x for them). Each output
  // is the same sum over the same blocks of in_features either way, so the
  // bits are the same.
  if (rows > out_features) {
    blocked_product(
        out_features, in_features, int(rows), weight, x, y, 1, y_row_stride);
  } else {
    blocked_product(
        rows, in_features, out_features, x, weight, y, y_row_stride, 1);
  }
}

template void dense_projection_forward<float>(
    int64_t, int, int, MatrixView<float>, MatrixView<float>, float*, int64_t);
template void dense_projection_forward<float16_t>(
    int64_t,
    int,
    int,
    MatrixView<float16_t>,
    MatrixView<float16_t>,
    float16_t*,
    int64_t);
template void dense_projection_forward<bfloat16_t>(
    int64_t,
    int,
    int,
    MatrixView<bfloat16_t>,
    MatrixView<bfloat16_t>,
    bfloat16_t*,
    int64_t);

}  // namespace mlx_gated_delta::cpu::MLX_GATED_DELTA_KERNEL_LEVEL
