#include "projection/projection_op.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "core/activation_type.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "projection/projection_cpu.h"
#include "validation/arguments.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

namespace {

// The rows of x [..., in]: the size of its leading shape (in may be 0).
int64_t leading_rows(const mx::array& x) {
  int64_t rows = 1;
  for (int axis = 0; axis + 1 < x.ndim(); ++axis) {
    rows *= x.shape(axis);
  }
  return rows;
}

// The width of the output row: the weights' out_i summed.
int row_width(const std::vector<mx::array>& inputs) {
  int width = 0;
  for (size_t i = 1; i < inputs.size(); i += 2) {
    width += inputs[i].shape(0);
  }
  return width;
}

}  // namespace

std::vector<mx::Shape> DenseProjection::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = row_width(inputs);
  return {shape};
}

namespace {

// `a` as a [rows, columns] matrix: a row-contiguous array of any rank, or a
// matrix with any strides (the vjp's transposed views).
template <typename T>
cpu::MatrixView<T> matrix_view(const mx::array& a, int columns) {
  if (a.flags().row_contiguous) {
    return {a.data<T>(), columns, 1};
  }
  if (a.ndim() != 2) {
    throw std::logic_error(
        "DenseProjection: an input of rank > 2 must be row-contiguous");
  }
  return {a.data<T>(), a.strides(0), a.strides(1)};
}

template <typename T>
void dispatch_linear(
    mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out) {
  const int64_t width = out.shape(-1);
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const mx::array& input : inputs) {
    encoder.set_input_array(input);
  }
  encoder.set_output_array(out);
  T* y_data = out.data<T>();
  int64_t column = 0;
  for (size_t i = 0; i < inputs.size(); i += 2) {
    const mx::array& x = inputs[i];
    const mx::array& weight = inputs[i + 1];
    const int in_features = weight.shape(1);
    const int out_features = weight.shape(0);
    const int64_t rows = leading_rows(x);
    const cpu::MatrixView<T> x_data = matrix_view<T>(x, in_features);
    const cpu::MatrixView<T> w_data = matrix_view<T>(weight, in_features);
    T* y_columns = y_data + column;
    column += out_features;
    if (rows == 0 || out_features == 0) {
      continue;
    }
    if (in_features == 0) {  // an empty sum: zeros, as MLX's matmul gives
      encoder.dispatch([=]() {
        for (int64_t r = 0; r < rows; ++r) {
          std::fill_n(y_columns + r * width, out_features, T(0.0f));
        }
      });
      continue;
    }
    encoder.dispatch([=]() {
      cpu::dense_projection_forward<T>(
          rows, in_features, out_features, x_data, w_data, y_columns, width);
    });
  }
}

// x weight^T for x [..., in] row-contiguous or a matrix, weight [out, in]
// a matrix: the primitive without dense_projection's checks and copies.
mx::array product(const mx::array& x, const mx::array& weight, mx::Stream s) {
  mx::Shape shape = x.shape();
  shape.back() = weight.shape(0);
  return mx::array(
      shape, x.dtype(), std::make_shared<DenseProjection>(s), {x, weight});
}

}  // namespace

void DenseProjection::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  with_activation_type(out.dtype(), "DenseProjection", [&]<typename T>(T) {
    dispatch_linear<T>(stream(), inputs, out);
  });
}

void DenseProjection::eval_gpu(
    const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "DenseProjection is a CPU kernel; on the GPU use MLX's matmul");
}

std::vector<mx::array> DenseProjection::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  const mx::Stream s = stream();
  const int width = row_width(primals);
  const int rows = static_cast<int>(leading_rows(primals[0]));
  // The x_i and the weights are row-contiguous already (the op functions
  // made them so); dy_i, dy_i^T, x_i^T and W_i^T below are views the kernel
  // reads through their strides, not copies.
  const mx::array dy =
      mx::reshape(mx::contiguous(cotangents[0], false, s), {rows, width}, s);
  std::vector<int> first_column(primals.size() / 2);
  for (size_t pair = 1; pair < first_column.size(); ++pair) {
    first_column[pair] =
        first_column[pair - 1] + primals[2 * pair - 1].shape(0);
  }
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    const int pair = arg / 2;
    const mx::array& x = primals[2 * pair];
    const mx::array& weight = primals[2 * pair + 1];
    const int start = first_column[pair];
    const mx::array dy_pair =
        mx::slice(dy, {0, start}, {rows, start + weight.shape(0)}, s);
    if (arg % 2 == 0) {
      // dx = dy W: the product x w^T with w = W^T [in, out].
      mx::array dx = product(dy_pair, mx::transpose(weight, s), s);
      grads.push_back(mx::reshape(dx, x.shape(), s));
    } else {
      // dW = dy^T x over all rows: a [out, N] times (x^T [in, N])^T.
      mx::array x_t = mx::transpose(mx::reshape(x, {rows, x.shape(-1)}, s), s);
      grads.push_back(product(mx::transpose(dy_pair, s), x_t, s));
    }
  }
  return grads;
}

namespace {

// Raises for a pair that dense_projection would not take; `op` names the
// caller and `pair` (or -1 for a single pair) which pair of the row.
void check_pair(
    const char* op,
    int pair,
    const mx::array& x,
    const mx::array& weight,
    mx::Dtype dtype) {
  std::ostringstream where;
  where << op << ": ";
  if (pair >= 0) {
    where << "pair " << pair << ": ";
  }
  if (x.ndim() < 1 || weight.ndim() != 2 || x.shape(-1) != weight.shape(1)) {
    std::ostringstream out;
    out << where.str()
        << "x [..., in] and weight [out, in] must agree on in; got x of rank "
        << x.ndim() << " and weight of rank " << weight.ndim();
    if (x.ndim() >= 1 && weight.ndim() == 2) {
      out << " (x in = " << x.shape(-1) << ", weight in = " << weight.shape(1)
          << ")";
    }
    throw std::invalid_argument(out.str());
  }
  if ((dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) ||
      x.dtype() != dtype || weight.dtype() != dtype) {
    std::ostringstream out;
    out << where.str()
        << "x and weight must share one of float32, float16, bfloat16";
    if (pair > 0) {
      out << " with pair 0's x (" << dtype << ")";
    }
    out << "; got x " << x.dtype() << " and weight " << weight.dtype();
    throw std::domain_error(out.str());
  }
}

mx::Stream cpu_stream(const char* op, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    std::ostringstream out;
    out << op << " is a CPU kernel; pass stream=mx.cpu";
    throw std::invalid_argument(out.str());
  }
  return stream;
}

// The primitive's output for checked pairs: the x_i and weights made
// row-contiguous, the row as wide as the weights' outputs summed.
mx::array projection_row(
    mx::Stream stream,
    const std::vector<mx::array>& xs,
    const std::vector<mx::array>& weights) {
  std::vector<mx::array> inputs;
  for (size_t i = 0; i < xs.size(); ++i) {
    inputs.push_back(mx::contiguous(xs[i], false, stream));
    inputs.push_back(mx::contiguous(weights[i], false, stream));
  }
  mx::Shape shape = xs[0].shape();
  shape.back() = row_width(inputs);
  return mx::array(
      shape, xs[0].dtype(), std::make_shared<DenseProjection>(stream), inputs);
}

}  // namespace

mx::array dense_projection(
    const mx::array& x, const mx::array& weight, mx::StreamOrDevice s) {
  check_pair("dense_projection", -1, x, weight, x.dtype());
  return projection_row(cpu_stream("dense_projection", s), {x}, {weight});
}

mx::array dense_projection_row(
    const std::vector<mx::array>& xs,
    const std::vector<mx::array>& weights,
    mx::StreamOrDevice s) {
  if (xs.empty() || xs.size() != weights.size()) {
    std::ostringstream out;
    out << "dense_projection_row: needs one weight per x, at least one pair; "
           "got "
        << xs.size() << " x and " << weights.size() << " weights";
    throw std::invalid_argument(out.str());
  }
  mx::Shape first = xs[0].shape();
  first.pop_back();
  for (size_t i = 0; i < xs.size(); ++i) {
    check_pair(
        "dense_projection_row", int(i), xs[i], weights[i], xs[0].dtype());
    mx::Shape leading = xs[i].shape();
    leading.pop_back();
    if (leading != first) {
      std::ostringstream out;
      out << "dense_projection_row: pair " << i << ": x's leading shape "
          << shape_string(leading) << " differs from pair 0's "
          << shape_string(first);
      throw std::invalid_argument(out.str());
    }
  }
  return projection_row(cpu_stream("dense_projection_row", s), xs, weights);
}

}  // namespace mlx_gated_delta
