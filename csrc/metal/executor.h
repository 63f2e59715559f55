// The Metal executor (macOS): runs a core gated-delta call or a fused segment
// call on MLX's Metal stream by encoding its plan (plan/plan.h) on MLX's
// command encoder. The primitives' eval_gpu call it under #ifdef _METAL_.
#pragma once

#include <vector>

#include "core/core_params.h"
#include "mlx/array.h"
#include "mlx/stream.h"
#include "segment/segment_params.h"

namespace mlx_gated_delta::metal {

// inputs: q, k, v (row-contiguous, one activation dtype), g, beta (float32),
// state (float32) [, mask (bool) when params.has_mask]. outputs: y (the
// activation dtype), state_out (float32); their memory is allocated here.
// `algorithm` may be Auto (resolve_metal_algorithm picks).
void eval_core_gpu(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& stream);

// inputs: mixed_qkvzba (activation dtype), conv_weight [C, K], decay_parameter,
// dt_bias, norm_weight (float32), conv_state (activation dtype), state
// (float32) [, mask (bool) when params.has_mask], all row-contiguous: the
// inputs of the segment primitive. outputs: out, conv_state_out (activation
// dtype), state_out (float32); allocated here. `algorithm` may be Auto.
void eval_segment_gpu(
    const SegmentParams& params,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& stream);

// The backward of one core call (plan/plan.h, make_backward_plan). inputs: q,
// k, v, g, beta, state [, mask], y's cotangent (the activation dtype) and the
// final state's (float32), row-contiguous: GatedDeltaRuleVJP's inputs.
// outputs: dq, dk, dv (activation dtype), dg, dgamma, dbeta, dstate
// (float32); allocated here. `algorithm` may be Auto (the forward call's).
void eval_backward_gpu(
    const GatedDeltaParams& params,
    Algorithm algorithm,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const mlx::core::Stream& stream);

}  // namespace mlx_gated_delta::metal
