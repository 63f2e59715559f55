// Every dispatch choice of the project, in one place: which algorithm "auto"
// runs on each backend and which kernel variant a shape takes. Plain C++ with
// no backend and no MLX dependency; the op functions, the primitives, the CPU
// kernels and the Metal plans all ask here.
#pragma once

#include "core/core_params.h"

namespace mlx_gated_delta {

// The algorithm "auto" resolves to on the CPU: the chunked form's per-chunk
// setup (gram, triangular solve, transposes) pays off from about 40 tokens on
// the Qwen3-Next shape; below, the recurrent form is faster (measured; see
// docs/numerics.md, "Choosing the algorithm").
Algorithm resolve_cpu_algorithm(const GatedDeltaParams& params);

// The backward's "auto" on the CPU: the recurrent form's reverse below
// kChunkedBackwardMinTokens, the chunked WY form's from there on (the
// crossover, measured on the Qwen3-Next shape: see docs/numerics.md,
// "Choosing the algorithm"), for scalar and per-key gates alike.
constexpr int kChunkedBackwardMinTokens = 8;
Algorithm resolve_cpu_backward_algorithm(const GatedDeltaParams& params);

// What "auto" runs on Metal: recurrent for short sequences (decode and up to
// one chunk, where the chunked form's extra passes cannot pay), for key
// dims the chunked stages do not cover, for trees and for per-key gates;
// chunked otherwise.
Algorithm resolve_metal_algorithm(const GatedDeltaParams& params);

// The backward's "auto" on Metal: the chunked WY form from
// kChunkedBackwardMinTokens on (scalar and per-key gates), the recurrent form
// below and for key dims the chunked stages do not cover. On paper
// (describe_plan's roofline, Qwen3-Next shape) the recurrent form, which moves
// the state through device memory about three times per token, and the WY form,
// a few times per chunk, cross between 4 and 8 tokens (T=4: 112 against 106 us;
// T=8: 197 against 109 us), where the CPU's measured crossover lies too. Not
// measured on an Apple GPU.
Algorithm resolve_metal_backward_algorithm(const GatedDeltaParams& params);

// The recurrent Metal kernel with one SIMD-group per state row slice can hold
// a key vector of Dk floats in SIMD lanes only when Dk is a multiple of the
// SIMD width and fits four values per lane.
bool supports_simd_delta(const GatedDeltaParams& params, int simd_width);

// The K K^T gram specialization shares one key head's gram between the value
// heads that read it; it pays only for Dk == 128 with repeated key heads.
bool uses_chunk_k_gram_k128(const GatedDeltaParams& params);

// The chunked CPU kernel runs the value heads of one key head in one task
// (sharing q/k loading and the grams) while that still leaves every one of
// `threads` threads a task; else one value head per task. Returns the value
// heads per task: Hv / Hk or 1.
int cpu_value_heads_per_task(const GatedDeltaParams& params, int threads);

}  // namespace mlx_gated_delta
