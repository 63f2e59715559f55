"""The registry of numerical contracts: every tolerance the tests hold.

A contract is an id `<area>.<op>.v<N>.<dtype>.<tensor>` (the dtype is the one of
the compared tensor), a metric, a threshold and the layout of the compared
tensor. Its fingerprint is the sha256 of its canonical text, and the table
of reviewed fingerprints (fingerprints.py) holds the one each contract was
reviewed with: changing a threshold here without a new id (visible in review)
makes every test that relied on the old one fail.

Metrics:
- `max_abs`: the largest |actual - expected|.
- `max_rel`: the largest |actual - expected| divided by the largest |expected|
  of the same batch row and head (docs/numerics.md), or by the
  contract's magnitude floor where that is larger.
- `norm_ratio`: ||actual - expected||_2 / ||expected||_2 over the whole tensor,
  the norm no less than the magnitude floor (and, for a contract measured
  against the terms, than the terms' norm: the projection's, `product_terms`).

The core op's `max_rel` contracts measure against the magnitude of the terms
each algorithm sums (`magnitude="terms"`), not only the result's: a step of
the recurrent form, and a chunk of the chunked form, build their state and
outputs from the state entering them, so where the keys contract that state
the terms cancel and float32 leaves an error relative to them
(docs/numerics.md, "What each algorithm guarantees"). The test passes those
magnitudes, from `term_magnitudes`.

Layouts name the axes, so `max_rel` knows which axes are the batch row (B) and
the head (H): `[B,T,H,D]` for y, `[B,H,Dv,Dk]` for the recurrent state.
"""

import hashlib
from dataclasses import dataclass

import numpy as np

from mlx_gated_delta.reference import (
    CHUNK_SIZE,
    key_head_of,
    qk_norm,
    state_magnitudes,
    to_float64,
)
from mlx_gated_delta.testing.fingerprints import FINGERPRINTS

METRICS = ("max_abs", "max_rel", "norm_ratio")
# What a relative metric divides by: the compared result's own magnitude, or
# also the magnitude of the terms the algorithm sums (`term_magnitudes`).
MAGNITUDES = ("result", "terms")
LAYOUTS = ("[B,T,H,D]", "[B,H,Dv,Dk]")
# The fused segment's conv state and a model's logits (no head axis: these
# layouts take max_abs or norm_ratio only).
LAYOUTS += ("[B,K,C]", "[B,T,V]")
# The chunked stages' scratch (docs/stages.md): per-token gates [B,T,H],
# per-chunk gate arrays [B,H,C,L], tiles [B,H,C,L,L] and rows [B,H,C,L,D].
LAYOUTS += ("[B,T,H]", "[B,H,C,L]", "[B,H,C,L,L]", "[B,H,C,L,D]")


@dataclass(frozen=True)
class Contract:
    id: str
    metric: str
    threshold: float
    layout: str
    magnitude_floor: float = 0.0  # relative metrics only
    magnitude: str = "result"  # one of MAGNITUDES; max_rel and norm_ratio

    @property
    def canonical_text(self):
        text = f"{self.id}|{self.metric}|{self.threshold!r}|{self.layout}|{self.magnitude_floor!r}"
        # Named only where it is not the default, so the contracts that
        # measure against the result keep their fingerprints.
        if self.magnitude != "result":
            text += f"|{self.magnitude}"
        return text

    @property
    def fingerprint(self):
        return hashlib.sha256(self.canonical_text.encode()).hexdigest()

    def group_axes(self):
        """The axes of the batch row and the head in this layout."""
        axes = self.layout.strip("[]").split(",")
        return (axes.index("B"), axes.index("H"))


# The float32 accuracy of every algorithm (docs/contract.md). The recurrence is
# non-expansive for beta in [0, 2] and |k| <= 1, so float32 rounding (2^-24 per
# operation) does not grow exponentially; over the few hundred tokens and
# 128-long dot products of the tests it stays near 1e-6, and the contract
# leaves headroom for longer sequences and reordered (chunked) sums.
_FLOAT32_RELATIVE = 1e-4
# float16 and bfloat16: the oracle sees the inputs already rounded to the dtype
# and the kernels compute in float32, so the extra error is the final rounding
# of y to the dtype, at most half an ulp: 2^-11 (float16, 10 mantissa bits) or
# 2^-8 (bfloat16, 7 mantissa bits) of the value, and so of the group's largest
# magnitude; plus the float32 contract above.
_FLOAT16_RELATIVE = 6e-4  # 2^-11 = 4.9e-4, + 1e-4
_BFLOAT16_RELATIVE = 4e-3  # 2^-8 = 3.9e-3, + 1e-4
# Two float32 computations that each meet the 1e-4 contract against the exact
# result differ from each other by at most the sum.
_TWO_FLOAT32_RELATIVE = 2e-4

# Values below 1e-2 of the tests' O(1) data scale are judged in absolute
# terms: 1e-6 under a 1e-4 contract, still some 15 float32 ulps of 1 and far
# below the error of any wrong formula.
_DATA_SCALE_FLOOR = 1e-2

_OUTPUT = "[B,T,H,D]"
_STATE = "[B,H,Dv,Dk]"


def _relative(contract_id, threshold, layout):
    return Contract(contract_id, "max_rel", threshold, layout, _DATA_SCALE_FLOOR)


def _relative_to_terms(contract_id, threshold, layout):
    return Contract(contract_id, "max_rel", threshold, layout, _DATA_SCALE_FLOOR, "terms")


def _norm_relative_to_terms(contract_id, threshold, layout):
    return Contract(contract_id, "norm_ratio", threshold, layout, _DATA_SCALE_FLOOR, "terms")


_CONTRACTS = (
    # The core op against the float64 oracle, per algorithm and dtype of y,
    # against the magnitude of the terms each algorithm sums: the states
    # from the entry of each step (recurrent) or chunk (chunked) on (v3; v2
    # measured against the result alone, which a step or chunk that
    # contracts a huge entry state does not meet: docs/numerics.md).
    _relative_to_terms("core.recurrent.v3.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("core.recurrent.v3.float16.output", _FLOAT16_RELATIVE, _OUTPUT),
    _relative_to_terms("core.recurrent.v3.bfloat16.output", _BFLOAT16_RELATIVE, _OUTPUT),
    _relative_to_terms("core.chunked.v3.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("core.chunked.v3.float16.output", _FLOAT16_RELATIVE, _OUTPUT),
    _relative_to_terms("core.chunked.v3.bfloat16.output", _BFLOAT16_RELATIVE, _OUTPUT),
    # The state is float32 whatever the activation dtype, and the oracle sees
    # the rounded inputs, so the float32 contract holds for every dtype.
    _relative_to_terms("core.recurrent.v3.float32.state", _FLOAT32_RELATIVE, _STATE),
    _relative_to_terms("core.chunked.v3.float32.state", _FLOAT32_RELATIVE, _STATE),
    # The two algorithms against each other, float32: each within its own
    # contract of the exact result, against the chunked form's terms (which
    # bound the recurrent form's: `term_magnitudes`).
    _relative_to_terms(
        "core.chunked_vs_recurrent.v3.float32.output", _TWO_FLOAT32_RELATIVE, _OUTPUT
    ),
    _relative_to_terms("core.chunked_vs_recurrent.v3.float32.state", _TWO_FLOAT32_RELATIVE, _STATE),
    # Per-key gates whose channels are all equal against the scalar gate, float32:
    # the two paths round differently (the recurrent form decays k's channels
    # before the prediction's dot product instead of the product after it;
    # the chunked form decays each term of the grams instead of the gram), so
    # the results are two float32 results each within 1e-4 of the same exact
    # value, not bitwise equal.
    _relative_to_terms("core.per_key_vs_scalar.v2.float32.output", _TWO_FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("core.per_key_vs_scalar.v2.float32.state", _TWO_FLOAT32_RELATIVE, _STATE),
    # Split continuity, recurrent: each token is the same float32 arithmetic
    # on the same float32 state whether the state was carried inside one call
    # or passed between calls, so the results are bitwise identical (any dtype
    # of y: the same float32 value rounds the same way).
    Contract("core.recurrent_split.v1.any.output", "max_abs", 0.0, _OUTPUT),
    Contract("core.recurrent_split.v1.float32.state", "max_abs", 0.0, _STATE),
    # Split continuity, chunked (float32): a split moves the chunk boundaries,
    # which reorders float32 sums; both sides still meet the 1e-4 contract, and
    # a wrong state carry shows as an O(1) error, far above this.
    _relative_to_terms("core.chunked_split.v3.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("core.chunked_split.v3.float32.state", _FLOAT32_RELATIVE, _STATE),
    # gated_delta_update against mx.fast.gated_delta_update in float32: MLX's
    # op loop is the same recurrence in float32, so both are within 1e-4 of
    # the exact result.
    _relative("compat.gated_delta_update.v2.float32.output", _TWO_FLOAT32_RELATIVE, _OUTPUT),
    _relative("compat.gated_delta_update.v2.float32.state", _TWO_FLOAT32_RELATIVE, _STATE),
    # gated_delta_update (algorithm "auto") against the float64 oracle: the
    # core op's contracts, by the same reasoning, against the chunked form's
    # terms (v3), which bound the recurrent form's too.
    _relative_to_terms("compat.update_oracle.v3.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("compat.update_oracle.v3.bfloat16.output", _BFLOAT16_RELATIVE, _OUTPUT),
    _relative_to_terms("compat.update_oracle.v3.float32.state", _FLOAT32_RELATIVE, _STATE),
)

# Checks of the oracle itself. A second float64 transcription of the same
# recurrence (another loop order, a transposed state) differs only by float64
# rounding: 2^-53 per operation over at most a few thousand operations.
_REFERENCE_CONTRACTS = (
    _relative("reference.transcription.v2.float64.output", 1e-12, _OUTPUT),
    _relative("reference.transcription.v2.float64.state", 1e-12, _STATE),
    # mx.fast.gated_delta_update is a float32 computation of the recurrence:
    # the float32 contract of docs/numerics.md against the exact result.
    _relative("reference.mlx_fast.v2.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative("reference.mlx_fast.v2.float32.state", _FLOAT32_RELATIVE, _STATE),
)

_CONV_STATE = "[B,K,C]"
_LOGITS = "[B,T,V]"

# The fused layer segment (docs/contract.md) and the drop-in layer.
_SEGMENT_CONTRACTS = (
    # The segment against its float64 oracle, any algorithm. The oracle sees
    # the inputs already rounded to the activation dtype and the segment keeps
    # every intermediate (conv output, gates, y, the norm) in float32, so the
    # core's contracts carry over: float32 rounding of y, then the gated norm
    # scales each (token, head) row of y to unit RMS, which scales its error
    # alike, and the final rounding of out to the dtype (half an ulp of the
    # value). Seen over 60 random shapes: 2.6e-6 (float32), 4.6e-4 (float16),
    # 3.5e-3 (bfloat16).
    # Against out's terms (v3): where y cancels, the norm scales y's error
    # up with it (`segment_terms`, docs/numerics.md). The state: the core's
    # contract against the core's terms (v3; v2 measured against the result
    # alone, which a segment call that contracts a huge entry state does not
    # meet: random draws with normalised keys of 8 to 32 dims and 63 to 127
    # tokens missed it by up to 7.3, the state's error being float32
    # rounding of the huge terms it erased).
    _relative_to_terms("segment.oracle.v3.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("segment.oracle.v3.float16.output", _FLOAT16_RELATIVE, _OUTPUT),
    _relative_to_terms("segment.oracle.v3.bfloat16.output", _BFLOAT16_RELATIVE, _OUTPUT),
    _relative_to_terms("segment.oracle.v3.float32.state", _FLOAT32_RELATIVE, _STATE),
    # The conv state is a copy of pre-conv inputs: exact, any dtype.
    Contract("segment.oracle.v1.any.conv_state", "max_abs", 0.0, _CONV_STATE),
    # Split continuity with the recurrent core: the same float32 arithmetic
    # per token whichever call it lands in, so bitwise identical.
    Contract("segment.recurrent_split.v1.any.output", "max_abs", 0.0, _OUTPUT),
    Contract("segment.recurrent_split.v1.float32.state", "max_abs", 0.0, _STATE),
    Contract("segment.recurrent_split.v1.any.conv_state", "max_abs", 0.0, _CONV_STATE),
    # Split continuity with the chunked core: a split moves chunk boundaries,
    # which reorders float32 sums; both sides meet the float32 contract,
    # against the larger of the two runs' terms (the state's, v3, as the
    # oracle's above).
    _relative_to_terms("segment.chunked_split.v3.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    _relative_to_terms("segment.chunked_split.v3.float32.state", _FLOAT32_RELATIVE, _STATE),
    # Our layer's recurrent state against mlx-lm's layer's, the same weights
    # and inputs, float32, unit-sized states: the threshold this comparison
    # held as the segment's oracle contract before v3 (each side's float32
    # error is a fraction of it at these sizes; seen: below 1e-6).
    _relative("layer.mlx_lm_parity.v1.float32.state", _FLOAT32_RELATIVE, _STATE),
    # A float32 mlx-lm model with our layers against the same model with
    # mlx-lm's: each layer output is two float32 computations of the same
    # math (each within 1e-4 of exact), and the rest of the model is the same
    # code on both sides. Seen on tiny random models: 2.9e-6.
    Contract(
        "layer.mlx_lm_parity.v2.float32.logits",
        "norm_ratio",
        _TWO_FLOAT32_RELATIVE,
        _LOGITS,
        _DATA_SCALE_FLOOR,
    ),
    # Our layer against itself run another way (token by token, batched with
    # padding, split prompt): float32 sums in another order (the chunked and
    # recurrent cores), each within the float32 contract of exact.
    Contract(
        "layer.self_consistency.v2.float32.logits",
        "norm_ratio",
        _TWO_FLOAT32_RELATIVE,
        _LOGITS,
        _DATA_SCALE_FLOOR,
    ),
    # The layer's dense projection (x W^T) against float64 on the same
    # rounded inputs: float32 dot products of length K err by about
    # sqrt(K) 2^-24 relative (3e-6 at K = 2048; 3.3e-7 seen), then the output
    # is rounded to its dtype (norm ratio at most half an ulp: 2^-11, 2^-8;
    # seen 2.3e-4 and 1.9e-3).
    # Against the norm of the terms the dot products sum, |x| |W|^T
    # (`product_terms`; v3): a float32 sum of K terms errs by a few 2^-24
    # of the sum of their magnitudes, whatever the sum. v2 measured against
    # the result alone, which a product that cancels does not meet: a drawn
    # dW of 30 O(1) terms summing to -7.8e-3 erred by 6.6e-7, 8e-5 of it.
    _norm_relative_to_terms("projection.linear.v3.float32.output", 1e-5, _LOGITS),
    _norm_relative_to_terms("projection.linear.v3.float16.output", _FLOAT16_RELATIVE, _LOGITS),
    _norm_relative_to_terms("projection.linear.v3.bfloat16.output", _BFLOAT16_RELATIVE, _LOGITS),
)

# Each stage of the pipelines against its namesake in the float64 reference
# (docs/stages.md), run on float32 inputs the reference also sees. A stage's
# output is computed in float32 from the float32 outputs of the stages before
# it, and the whole pipeline meets the core's float32 contract of 1e-4
# against the exact result; every stage on the way is a sum of O(1) float32
# products no longer than the pipeline's (64-term cumsums, Dk-long dot
# products, 64 x 64 triangular solves of a unit lower triangular matrix whose
# entries are at most beta |k|^2 <= 1 with the tests' normalised keys), so the
# same 1e-4 bounds each stage. What the kernels only copy is exact.
_GATES = "[B,T,H]"
_CHUNK_ARRAY = "[B,H,C,L]"
_TILE = "[B,H,C,L,L]"
_ROWS = "[B,H,C,L,D]"
_STAGE_CONTRACTS = (
    _relative("stage.qk_norm.v1.float32.inverse_norm", _FLOAT32_RELATIVE, _GATES),
    _relative("stage.gate_cumsum.v1.float32.log_cumsum", _FLOAT32_RELATIVE, _CHUNK_ARRAY),
    Contract("stage.gate_cumsum.v1.int32.last_wipe", "max_abs", 0.0, _CHUNK_ARRAY),
    Contract("stage.gate_cumsum.v1.float32.beta", "max_abs", 0.0, _CHUNK_ARRAY),
    _relative("stage.k_gram.v1.float32.tile", _FLOAT32_RELATIVE, _TILE),
    _relative("stage.chunk_qk.v1.float32.tile", _FLOAT32_RELATIVE, _TILE),
    _relative("stage.kkt_inverse.v1.float32.tile", _FLOAT32_RELATIVE, _TILE),
    _relative("stage.recompute_w_u.v1.float32.w", _FLOAT32_RELATIVE, _ROWS),
    _relative("stage.recompute_w_u.v1.float32.u", _FLOAT32_RELATIVE, _ROWS),
    _relative("stage.chunk_carry.v1.float32.corrected", _FLOAT32_RELATIVE, _ROWS),
    _relative("stage.chunk_carry.v1.float32.output_inter", _FLOAT32_RELATIVE, _ROWS),
    _relative("stage.chunk_carry.v1.float32.state", _FLOAT32_RELATIVE, _STATE),
    _relative("stage.chunk_output.v1.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    # Per-key gates: gate_cumsum's arrays per channel ([B,H,C,L,Dk], the
    # same 64-term float32 cumsum and copied wipe positions), and the
    # decayed tiles of key_decayed_grams. Each tile entry is a Dk-long float32
    # sum of terms q_ic k_jc decay(i, j, c) with decay <= 1, each decay the
    # float32 exp of a difference of two such cumsums, or a product of two
    # such exps that lie in [e^-80, e^80] (the sub-chunk form): a few float32
    # roundings of each term, plus the rounding of the cumsums, a few 1e-7
    # of their size times the decay, which stays under 1e-5 wherever the
    # decay is not negligible for gates of at most 1 a step (a strong
    # channel's cumsum grows large only where its decays are tiny). So the
    # same 1e-4 as the tiles of the scalar gates.
    _relative("stage.key_gate_cumsum.v1.float32.log_cumsum", _FLOAT32_RELATIVE, _ROWS),
    Contract("stage.key_gate_cumsum.v1.int32.last_wipe", "max_abs", 0.0, _ROWS),
    _relative("stage.key_decayed_grams.v1.float32.tile", _FLOAT32_RELATIVE, _TILE),
    # The segment's own stages: prepare_conv is a K-tap float32 dot product
    # and a SiLU, prepare_gates a softplus and a sigmoid of float32 values,
    # gated_norm an RMS over Dv; float32 rounding, far below 1e-4.
    _relative("stage.prepare_conv.v1.float32.qkv", _FLOAT32_RELATIVE, _OUTPUT),
    _relative("stage.prepare_gates.v1.float32.gates", _FLOAT32_RELATIVE, _GATES),
    Contract("stage.collect_conv_state.v1.any.conv_state", "max_abs", 0.0, _CONV_STATE),
    _relative("stage.gated_norm.v1.float32.output", _FLOAT32_RELATIVE, _OUTPUT),
    # The chunked reference against the recurrent oracle: two float64
    # computations of the same result, different only by float64 rounding.
    _relative("reference.chunked.v1.float64.output", 1e-12, _OUTPUT),
    _relative("reference.chunked.v1.float64.state", 1e-12, _STATE),
)

# Gradients (docs/contract.md, gradients), compared norm-wise per tensor: the
# activations' gradients (q, k, v: `activation_grad`), the gates' (g or
# gamma, beta: `gate_grad`) and the initial state's (`state_grad`).
_GRADIENT_TENSORS = (("activation_grad", _OUTPUT), ("gate_grad", _GATES), ("state_grad", _STATE))


def _gradient_contracts(prefix, threshold):
    return tuple(
        Contract(f"{prefix}.{tensor}", "norm_ratio", threshold, layout, _DATA_SCALE_FLOOR)
        for tensor, layout in _GRADIENT_TENSORS
    )


_GRADIENT_CONTRACTS = (
    # The float64 reference backward against central finite differences of
    # the float64 forward (step 1e-6): truncation h^2 |f'''| ~ 1e-12 and
    # cancellation 2^-53 / h ~ 1e-10 relative, so 1e-6 leaves room for the
    # few hundred operations of a test case and still sees any wrong term.
    *_gradient_contracts("reference.finite_difference.v1.float64", 1e-6),
    # The chunked backward's float64 stages against the float64 recurrence
    # backward: two float64 computations of one gradient, different only by
    # float64 rounding (the inverse T and sums over a chunk: well under 1e-10
    # relative), while any wrong or missing term of the derivation is O(1).
    *_gradient_contracts("reference.chunked_grad.v1.float64", 1e-10),
    # The kernels' gradients against the float64 reference backward, on the
    # same rounded inputs and cotangents (docs/contract.md, gradients: float32 to about
    # 1e-3). The backward accumulates in float32 whatever the activation
    # dtype; seen over 150 drawn cases: 7.3e-6 (float32, q k v), 1.5e-6
    # (gates), 3.1e-7 (state).
    *_gradient_contracts("core_grad.oracle.v1.float32", 1e-3),
    # A gradient returned in float16 or bfloat16 (q, k, v, and g or beta given
    # in that dtype) adds its final rounding, at most half an ulp of each
    # element and so of the norm: 2^-11 = 4.9e-4 and 2^-8 = 3.9e-3, on top of
    # the float32 contract. Seen over 150 drawn cases: 4.0e-4 (float16),
    # 3.4e-3 (bfloat16).
    *_gradient_contracts("core_grad.oracle.v1.float16", 1.5e-3)[:2],
    *_gradient_contracts("core_grad.oracle.v1.bfloat16", 5e-3)[:2],
    # Two float32 computations of one gradient, each within the 1e-3 contract
    # of the exact one: split over calls that carry the state, the chunked
    # and the recurrent forward, and under mx.compile / mx.vmap. A wrong carry
    # or a lost term shows as an O(1) error.
    *_gradient_contracts("core_grad.split.v1.float32", 2e-3),
    *_gradient_contracts("core_grad.algorithms.v1.float32", 2e-3),
    *_gradient_contracts("core_grad.transforms.v1.float32", 2e-3),
)

# The segment's packed input and its parameters (any shape; these layouts
# take norm_ratio only).
LAYOUTS += ("[B,T,F]", "[P]")

# The segment's gradients, norm-wise per tensor: the packed input's and the
# conv state's (`input_grad`, in the activation dtype), the parameters'
# (conv weight, decay parameter, dt_bias, norm weight: `parameter_grad`) and
# the initial state's (`state_grad`, float32).
_SEGMENT_GRADIENT_TENSORS = (
    ("input_grad", "[B,T,F]"),
    ("parameter_grad", "[P]"),
    ("state_grad", _STATE),
)


def _segment_gradient_contracts(prefix, threshold, tensors=_SEGMENT_GRADIENT_TENSORS):
    return tuple(
        Contract(f"{prefix}.{tensor}", "norm_ratio", threshold, layout, _DATA_SCALE_FLOOR)
        for tensor, layout in tensors
    )


_SEGMENT_GRADIENT_CONTRACTS = (
    # The segment's gradients against central finite differences (step 1e-6)
    # of the float64 segment oracle, on the same rounded inputs and
    # cotangents. The backward is float32 throughout (the conv, gates and
    # norm as MLX float32 ops, the recurrence through the core's backward), so
    # the core's float32 gradient contract (docs/contract.md, gradients: about 1e-3)
    # applies; the finite differences add about 1e-9. Seen over 60 drawn
    # cases: 3.0e-7 (packed input, conv state), 1.0e-6 (parameters), 3.6e-7
    # (state).
    *_segment_gradient_contracts("segment_grad.oracle.v1.float32", 1e-3),
    # A gradient returned in float16 or bfloat16 (the packed input's and the
    # conv state's) adds its final rounding, half an ulp of each element:
    # 2^-11 = 4.9e-4 and 2^-8 = 3.9e-3 on top of the float32 contract, as for
    # the core. The parameters' and the state's gradients stay float32.
    # Seen over 60 drawn cases: 3.0e-4 (float16), 1.9e-3 (bfloat16).
    *_segment_gradient_contracts(
        "segment_grad.oracle.v1.float16", 1.5e-3, _SEGMENT_GRADIENT_TENSORS[:1]
    ),
    *_segment_gradient_contracts(
        "segment_grad.oracle.v1.bfloat16", 5e-3, _SEGMENT_GRADIENT_TENSORS[:1]
    ),
    # Two float32 computations of one gradient, each within the 1e-3
    # contract: split over calls that carry both states, the chunked and the
    # recurrent core, and under mx.compile / mx.vmap.
    *_segment_gradient_contracts("segment_grad.split.v1.float32", 2e-3),
    *_segment_gradient_contracts("segment_grad.algorithms.v1.float32", 2e-3),
    *_segment_gradient_contracts("segment_grad.transforms.v1.float32", 2e-3),
    # A patched float32 mlx-lm model's parameter gradients against the stock
    # model's (mlx-lm's own layers, differentiated through its op loop): two
    # float32 computations of the same gradient, each within the 1e-3
    # contract of exact.
    Contract(
        "layer_grad.mlx_lm_parity.v1.float32.parameter_grad",
        "norm_ratio",
        2e-3,
        "[P]",
        _DATA_SCALE_FLOOR,
    ),
    # The loss curve of a short LoRA run (Adam) on a patched model against
    # the same run on the stock model: each step's loss, relative to the
    # curve's norm. The curves start from the same loss within float32 and
    # part only by the float32 gradient differences above, which Adam (its
    # first steps are about lr * sign(g)) amplifies: the stock model against
    # itself with its weights perturbed by 1e-6 relative parts by 4.9e-4 over
    # 20 steps at lr 1e-4 (1.4e-2 at lr 1e-3, where neither side is
    # reproducible to this contract). Runs of smooth models (no top-k expert
    # routing, whose choice a float32 difference can flip) at lr 1e-4.
    Contract(
        "layer_train.lora_curve.v1.float32.loss", "norm_ratio", 2e-3, "[P]", _DATA_SCALE_FLOOR
    ),
)

CONTRACTS = {
    contract.id: contract
    for contract in _CONTRACTS
    + _REFERENCE_CONTRACTS
    + _SEGMENT_CONTRACTS
    + _STAGE_CONTRACTS
    + _GRADIENT_CONTRACTS
    + _SEGMENT_GRADIENT_CONTRACTS
}


def review_disagreements(registry=CONTRACTS, reviewed=FINGERPRINTS):
    """Where the registry and the table of reviewed fingerprints disagree,
    both ways: one message a contract id, sorted; empty where they agree."""
    ids = sorted(set(registry) | set(reviewed))
    found = (_disagreement(i, registry.get(i), reviewed.get(i)) for i in ids)
    return [problem for problem in found if problem]


def _disagreement(contract_id, contract, fingerprint):
    """Why `contract` is not the one reviewed as `fingerprint`, or None."""
    if contract is None:
        return f"{contract_id}: a reviewed fingerprint, but no such contract (stale)"
    if fingerprint is None:
        return f"{contract_id}: no reviewed fingerprint"
    if fingerprint != contract.fingerprint:
        return (
            f"{contract_id}: fingerprint {contract.fingerprint} "
            f"({contract.canonical_text}), reviewed as {fingerprint}; "
            "a changed tolerance needs a new id"
        )
    return None


def assert_matches(name, actual, expected, contract_id, terms=None):
    """Fails unless `actual` meets contract `contract_id` against `expected`.

    The contract must be the one reviewed: its fingerprint must be the one
    the table of reviewed fingerprints holds for `contract_id` (fingerprints.py).
    `terms` is given exactly for the contracts whose magnitude is
    "terms": magnitudes broadcastable to `expected`'s shape (one of
    `term_magnitudes`' results, or `product_terms`). On a violation the message gives the
    worst element: its index, actual and expected values and the metric.
    Returns the metric's value.
    """
    contract = CONTRACTS.get(contract_id)
    if contract is None:
        raise AssertionError(f"{name}: no numerical contract {contract_id!r}")
    if (terms is None) != (contract.magnitude == "result"):
        raise AssertionError(
            f"{name}: contract {contract_id} measures against the {contract.magnitude} "
            f"magnitude, and terms were {'not ' if terms is None else ''}given"
        )
    problem = _disagreement(contract_id, contract, FINGERPRINTS.get(contract_id))
    if problem is not None:
        raise AssertionError(f"{name}: contract {problem}")
    actual = to_float64(actual)
    expected = to_float64(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape}, expected {expected.shape}")
    if actual.size == 0:
        return 0.0

    # A NaN anywhere is the worst possible error, never a pass.
    error = np.nan_to_num(np.abs(actual - expected), nan=np.inf)
    floor = contract.magnitude_floor
    magnitude = np.ones_like(error)
    if contract.metric == "max_abs":
        weighted = error
        value = float(error.max())
    elif contract.metric == "max_rel":
        magnitude = _group_magnitude(np.abs(expected), contract.group_axes())
        if terms is not None:
            terms = np.broadcast_to(to_float64(terms), error.shape)
            magnitude = np.maximum(magnitude, _group_magnitude(terms, contract.group_axes()))
        magnitude = np.broadcast_to(np.maximum(magnitude, floor), error.shape)
        weighted = error / magnitude
        value = float(weighted.max())
    elif contract.metric == "norm_ratio":
        weighted = error
        norm = max(float(np.linalg.norm(expected)), floor)
        if terms is not None:
            norm = max(norm, float(np.linalg.norm(np.broadcast_to(to_float64(terms), error.shape))))
        value = float(np.sqrt(np.sum(error * error))) / norm
    else:
        raise AssertionError(f"{name}: unknown metric {contract.metric!r}")

    if not value <= contract.threshold:
        worst = np.unravel_index(int(np.argmax(weighted)), error.shape)
        worst = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{name}: {contract_id} violated: {contract.metric} = {value:.3e} > "
            f"{contract.threshold:.3e}; worst element at index {worst}: "
            f"actual {float(actual[worst])!r}, expected {float(expected[worst])!r}, "
            f"|error| {error[worst]:.3e}, group magnitude {magnitude[worst]:.3e}"
        )
    return value


def _group_magnitude(magnitude, group_axes):
    """Largest magnitude per (batch row, head), kept broadcastable."""
    reduced = tuple(a for a in range(magnitude.ndim) if a not in group_axes)
    return magnitude.max(axis=reduced, keepdims=True)


def product_terms(left, right):
    """The magnitudes of the terms a matrix product sums, |left| @ |right|
    in float64: the error of each float32 dot product is a few 2^-24 of
    its entry here, however much the terms cancel."""
    return np.abs(to_float64(left)) @ np.abs(to_float64(right))


def term_magnitudes(q, k, v, g, beta, state=None, *, algorithm, call_starts=(0,), **options):
    """The magnitudes an algorithm's float32 error scales with, for the core
    op's arguments and options (docs/numerics.md, "What each algorithm
    guarantees"): `(output_terms [B, T, Hv, 1], state_terms [B, T + 1, Hv])`,
    for y at each token and for the state after each token (index 0: the
    entry state). The recurrent form applies one token at a time (steps of
    1); the chunked form, and "auto", whose magnitudes bound both forms',
    take chunks of CHUNK_SIZE.

    A chunk (from the start of a call; `call_starts` lists the tokens where
    the calls of a split run start) sums terms of the states it spans, its
    entry state included: `m`, their largest |entry|. An error made before
    the chunk is carried through it, which can only shrink it by the weakest
    channel's decay since the chunk's start, `G(t)` (the keys' projections
    are non-expansive), so a result at token t is measured against
    `max(m, G(t) M)`, M the magnitude at the end of the chunk before. y at a
    token is `scale S q`, whose terms are at most that times `|scale q|_1`.
    The magnitudes of chunks of 64 bound those of steps of 1.
    """
    chunk_size = 1 if algorithm == "recurrent" else CHUNK_SIZE
    magnitudes = state_magnitudes(q, k, v, g, beta, state, **options)
    q, g = to_float64(q), to_float64(g)
    batch, tokens, key_heads, key_dim = q.shape
    value_heads = g.shape[2]
    mask = options.get("mask")
    active = np.ones((batch, tokens), bool) if mask is None else np.asarray(mask, dtype=bool)
    # A masked token does not decay the state; per-key gates keep their
    # channel axis until the weakest channel is taken.
    log_decay = np.where(active.reshape(batch, tokens, *([1] * (g.ndim - 2))), g, 0.0)
    if options.get("normalize_qk"):
        q = qk_norm(q)
    scale = options.get("scale")
    if scale is None:
        scale = key_dim**-0.5
    key_head = key_head_of(value_heads, key_heads, options.get("head_mapping", "grouped"))
    query_terms = np.abs(scale) * np.abs(q[:, :, key_head]).sum(axis=-1)  # [B, T, Hv]

    state_terms = np.empty_like(magnitudes)
    state_terms[:, 0] = magnitudes[:, 0]
    ends = (*call_starts[1:], tokens)
    for call_start, call_end in zip(call_starts, ends):
        for start in range(call_start, call_end, chunk_size):
            end = min(start + chunk_size, call_end)
            carried = np.exp(np.cumsum(log_decay[:, start:end], axis=1))  # [B, L, Hv(, Dk)]
            if carried.ndim == 4:
                carried = carried.max(axis=-1)
            before = state_terms[:, start, None]  # [B, 1, Hv]
            spanned = magnitudes[:, start : end + 1].max(axis=1, keepdims=True)
            state_terms[:, start + 1 : end + 1] = np.maximum(spanned, carried * before)
    output_terms = state_terms[:, 1:] * query_terms * active[:, :, None]
    return output_terms[..., None], state_terms
