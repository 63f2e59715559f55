"""Float64 NumPy oracles of the gated-delta ops, independent of the C++.

`gated_delta_rule_reference` transcribes the contract (docs/contract.md)
directly: a loop over tokens, with batch rows and heads vectorised, everything
in float64. Beside it, `gated_delta_rule_chunked_reference` computes the same
thing in the chunked form, built from one function per stage with the names the
CPU and Metal kernels use (docs/stages.md); the per-stage tests compare each
kernel stage with its namesake here. The segment oracle is split into its
stages the same way. The tests compare each fast path against these functions
through the contracts of `testing.contracts`.

Arguments may be NumPy arrays of any float dtype or mlx arrays; callers that
test a low-precision path pass the inputs already rounded to that dtype, so the
oracle sees exactly the numbers the kernel sees.

One module per part, every name importable from here:

- `recurrent`: the recurrent oracles, their gradients and the shared helpers;
- `chunked`: the chunked form, stage by stage;
- `chunked_per_key`: its stages with per-key-channel gates;
- `chunked_backward`: the chunked backward, stage by stage;
- `chunked_backward_per_key`: its stages with per-key-channel gates;
- `segment`: the fused layer segment, stage by stage.
"""

from .chunked import (
    CHUNK_SIZE,
    chunk_carry,
    chunk_decay,
    chunk_output,
    chunk_qk,
    chunk_rows,
    chunked_stages,
    decay_from_start,
    gate_cumsum,
    gated_delta_rule_chunked_reference,
    k_gram,
    kkt_inverse,
    recompute_w_u,
)
from .chunked_backward import (
    chunk_carry_backward,
    chunk_output_backward,
    chunked_backward_stages,
    gate_cumsum_backward,
    gated_delta_rule_chunked_reference_vjp,
    kkt_inverse_backward,
    recompute_w_u_backward,
)
from .chunked_backward_per_key import (
    gated_delta_rule_per_key_chunked_reference_vjp,
    key_chunk_carry_backward,
    key_chunk_output_backward,
    key_gate_cumsum_backward,
    key_kkt_inverse_backward,
    key_recompute_w_u_backward,
    per_key_chunked_backward_stages,
)
from .chunked_per_key import (
    key_chunk_carry,
    key_chunk_decay,
    key_decayed_grams,
    key_gate_cumsum,
    per_key_chunked_stages,
)
from .recurrent import (
    QK_NORM_EPS,
    gated_delta_rule_reference,
    gated_delta_rule_reference_vjp,
    gated_delta_update_reference,
    gated_delta_update_reference_vjp,
    key_head_of,
    qk_norm,
    qk_norm_backward,
    state_magnitudes,
    to_float64,
)
from .segment import (
    SegmentCore,
    SegmentLayout,
    collect_conv_state,
    gated_delta_segment_reference,
    gated_norm,
    prepare_conv,
    prepare_gates,
    segment_core_inputs,
)

__all__ = [
    "CHUNK_SIZE",
    "QK_NORM_EPS",
    "SegmentCore",
    "SegmentLayout",
    "chunk_carry",
    "chunk_carry_backward",
    "chunk_decay",
    "chunk_output",
    "chunk_output_backward",
    "chunked_backward_stages",
    "chunk_qk",
    "chunk_rows",
    "chunked_stages",
    "collect_conv_state",
    "decay_from_start",
    "gate_cumsum",
    "gate_cumsum_backward",
    "gated_delta_rule_chunked_reference",
    "gated_delta_rule_chunked_reference_vjp",
    "gated_delta_rule_per_key_chunked_reference_vjp",
    "per_key_chunked_backward_stages",
    "gated_delta_rule_reference",
    "gated_delta_rule_reference_vjp",
    "gated_delta_segment_reference",
    "gated_delta_update_reference",
    "gated_delta_update_reference_vjp",
    "gated_norm",
    "k_gram",
    "key_chunk_carry",
    "key_chunk_carry_backward",
    "key_chunk_output_backward",
    "key_chunk_decay",
    "key_decayed_grams",
    "key_gate_cumsum",
    "key_gate_cumsum_backward",
    "key_head_of",
    "key_kkt_inverse_backward",
    "key_recompute_w_u_backward",
    "kkt_inverse",
    "kkt_inverse_backward",
    "prepare_conv",
    "per_key_chunked_stages",
    "prepare_gates",
    "qk_norm",
    "qk_norm_backward",
    "recompute_w_u",
    "recompute_w_u_backward",
    "segment_core_inputs",
    "state_magnitudes",
    "to_float64",
]
