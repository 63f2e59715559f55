// vmap by folding the mapped axis into the batch axis, shared by the core's
// and the segment's primitives: every batch-carrying input of both ops has
// the batch as its leading axis, so mapping over V copies of a batch of B is
// one call on a batch of V*B.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/ops.h"

namespace mlx_gated_delta {

// The size of the mapped axis: that of the first input with one.
inline int vmap_size(
    const std::vector<mlx::core::array>& inputs, const std::vector<int>& axes) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (axes[i] >= 0) {
      return inputs[i].shape(axes[i]);
    }
  }
  return 1;
}

// `x` with its mapped axis (or, for an unmapped input, `size` broadcast
// copies) folded into its leading batch axis, contiguous.
inline mlx::core::array fold_into_batch(
    const mlx::core::array& x, int axis, int size, mlx::core::Stream s) {
  namespace mx = mlx::core;
  mx::Shape copies = x.shape();
  copies.insert(copies.begin(), size);
  const mx::array mapped = axis >= 0
      ? mx::moveaxis(x, axis, 0, s)
      : mx::broadcast_to(mx::expand_dims(x, 0, s), copies, s);
  mx::Shape shape(mapped.shape().begin() + 1, mapped.shape().end());
  shape[0] *= size;
  return mx::contiguous(mx::reshape(mapped, shape, s), false, s);
}

// An output of the folded call, [size * B, ...], back to [size, B, ...].
inline mlx::core::array unfold_from_batch(
    const mlx::core::array& out, int size, mlx::core::Stream s) {
  mlx::core::Shape shape = out.shape();
  shape[0] /= size;
  shape.insert(shape.begin(), size);
  return mlx::core::reshape(out, shape, s);
}

}  // namespace mlx_gated_delta
