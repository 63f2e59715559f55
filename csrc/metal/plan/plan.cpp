// The functions of the plan's types (plan.h).
#include "metal/plan/plan.h"

namespace mlx_gated_delta::metal {

const char* to_string(ActivationDtype dtype) {
  switch (dtype) {
    case ActivationDtype::Float32:
      return "float32";
    case ActivationDtype::Float16:
      return "float16";
    case ActivationDtype::BFloat16:
      return "bfloat16";
  }
  return "?";
}

size_t element_bytes(ActivationDtype dtype) {
  return dtype == ActivationDtype::Float32 ? 4 : 2;
}

const char* to_string(PlanBuffer buffer) {
  static const char* const names[] = {
      "q",
      "k",
      "v",
      "g",
      "beta",
      "mask",
      "state_in",
      "y",
      "state_out",
      "query_inverse_norm",
      "key_inverse_norm",
      "gate_cumsum",
      "wipe_mask",
      "beta_effective",
      "k_gram",
      "kkt_inverse",
      "w",
      "u",
      "qk",
      "output_inter",
      "mixed",
      "conv_weight",
      "decay_parameter",
      "dt_bias",
      "norm_weight",
      "conv_state_in",
      "out",
      "conv_state_out",
      "checkpoints",
      "checkpoint_states",
      "conv_checkpoint_states",
      "parents",
      "tree_states",
      "y_cotangent",
      "state_cotangent",
      "dq",
      "dk",
      "dv",
      "dg",
      "dgamma",
      "dbeta",
      "dstate",
      "boundary_states",
      "chunk_states",
      "query_head_grad",
      "key_head_grad",
      "corrected_grad",
      "w_grad",
      "kkt_inverse_grad",
      "decay_entry_terms",
      "decay_pair_terms",
      "decay_exit_terms",
      "qk_grad",
      "kkt_grad",
      "tiny_decay_mask"};
  static_assert(sizeof(names) / sizeof(names[0]) == size_t(PlanBuffer::Count));
  return names[int(buffer)];
}

const BufferSpec* Plan::find_buffer(PlanBuffer buffer) const {
  for (const BufferSpec& spec : buffers) {
    if (spec.buffer == buffer)
      return &spec;
  }
  return nullptr;
}

uint64_t Plan::buffer_bytes(PlanBuffer buffer) const {
  const BufferSpec* spec = find_buffer(buffer);
  return spec ? spec->bytes : 0;
}

const void* Plan::params_data(const Dispatch& dispatch) const {
  return dispatch.params_block == KernelParamsBlock::Core
      ? static_cast<const void*>(&kernel_params)
      : static_cast<const void*>(&segment_params);
}

size_t Plan::params_size(const Dispatch& dispatch) const {
  return dispatch.params_block == KernelParamsBlock::Core
      ? sizeof(kernel_params)
      : sizeof(segment_params);
}

}  // namespace mlx_gated_delta::metal
