#include "projection/projection_op.h"

#include <sstream>
#include <stdexcept>

#include "core/activation_type.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "projection/projection_cpu.h"

namespace mx = mlx::core;

namespace mlx_gated_delta {

std::vector<mx::Shape> DenseProjection::output_shapes(
    const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
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
  const mx::array& x = inputs[0];
  const mx::array& weight = inputs[1];
  const int in_features = weight.shape(1);
  const int out_features = weight.shape(0);
  const int64_t rows = x.size() / in_features;
  const cpu::MatrixView<T> x_data = matrix_view<T>(x, in_features);
  const cpu::MatrixView<T> w_data = matrix_view<T>(weight, in_features);
  T* y_data = out.data<T>();
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(x);
  encoder.set_input_array(weight);
  encoder.set_output_array(out);
  encoder.dispatch([=]() {
    cpu::dense_projection_forward<T>(
        rows, in_features, out_features, x_data, w_data, y_data);
  });
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
  const mx::array& x = primals[0];
  const mx::array& weight = primals[1];
  const mx::Stream s = stream();
  // x and the weight are row-contiguous already (dense_projection made them
  // so); the transposes below are views the kernel reads through their
  // strides, not copies.
  const mx::array dy = mx::contiguous(cotangents[0], false, s);
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      // dx = dy W: the product x w^T with w = W^T [in, out].
      grads.push_back(product(dy, mx::transpose(weight, s), s));
    } else {
      // dW = dy^T x over all rows: a [out, N] times (x^T [in, N])^T.
      const int rows = static_cast<int>(x.size() / x.shape(-1));
      mx::array dy_t =
          mx::transpose(mx::reshape(dy, {rows, weight.shape(0)}, s), s);
      mx::array x_t = mx::transpose(mx::reshape(x, {rows, x.shape(-1)}, s), s);
      grads.push_back(product(dy_t, x_t, s));
    }
  }
  return grads;
}

mx::array dense_projection(
    const mx::array& x, const mx::array& weight, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || weight.ndim() != 2 || x.shape(-1) != weight.shape(1)) {
    std::ostringstream out;
    out << "dense_projection: x [..., in] and weight [out, in] must agree on "
           "in; got x of rank "
        << x.ndim() << " and weight of rank " << weight.ndim();
    if (x.ndim() >= 1 && weight.ndim() == 2) {
      out << " (x in = " << x.shape(-1) << ", weight in = " << weight.shape(1)
          << ")";
    }
    throw std::invalid_argument(out.str());
  }
  const mx::Dtype dtype = x.dtype();
  if ((dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) ||
      weight.dtype() != dtype) {
    std::ostringstream out;
    out << "dense_projection: x and weight must share one of float32, "
           "float16, bfloat16; got x "
        << x.dtype() << " and weight " << weight.dtype();
    throw std::domain_error(out.str());
  }
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(
        "dense_projection is a CPU kernel; pass stream=mx.cpu");
  }
  mx::Shape shape = x.shape();
  shape.back() = weight.shape(0);
  return mx::array(
      shape,
      dtype,
      std::make_shared<DenseProjection>(stream),
      {mx::contiguous(x, false, stream),
       mx::contiguous(weight, false, stream)});
}

}  // namespace mlx_gated_delta
