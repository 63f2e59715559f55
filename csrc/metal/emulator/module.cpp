// _mlx_gated_delta_metal_emulator, imported as mlx_gated_delta._metal_emulator:
// the Metal plans and kernels run on the CPU, for tests
// (mlx_gated_delta/testing/metal_emulated.py wraps it). Not part of the op's
// fast path; raw bytes in and out keep it free of MLX types.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>

#include "dispatch.h"
#include "executor.h"
#include "guarded_buffer.h"
#include "metal/plan/plan.h"

namespace nb = nanobind;
using namespace mlx_gated_delta;
using namespace mlx_gated_delta::metal;

namespace {

metal::ActivationDtype parse_dtype(const std::string& name) {
  if (name == "float32")
    return ActivationDtype::Float32;
  if (name == "float16")
    return ActivationDtype::Float16;
  if (name == "bfloat16")
    return ActivationDtype::BFloat16;
  throw std::invalid_argument(
      "dtype must be float32, float16 or bfloat16, got " + name);
}

GatedDeltaParams make_params(
    int batch,
    int tokens,
    int key_heads,
    int value_heads,
    int key_dim,
    int value_dim,
    float scale,
    const std::string& head_mapping,
    bool normalize_qk,
    bool has_mask,
    bool per_key_gates = false) {
  GatedDeltaParams p =
      shape_params(batch, tokens, key_heads, value_heads, key_dim, value_dim);
  p.scale = scale;
  p.head_mapping = parse_head_mapping(head_mapping);
  p.normalize_qk = normalize_qk;
  p.has_mask = has_mask;
  p.per_key_gates = per_key_gates;
  return p;
}

std::span<const std::byte> view(const nb::bytes& data) {
  return {reinterpret_cast<const std::byte*>(data.c_str()), data.size()};
}

nb::bytes to_bytes(const std::vector<std::byte>& data) {
  return nb::bytes(reinterpret_cast<const char*>(data.data()), data.size());
}

// The number of int32 positions in a checkpoints argument (0 without one).
int checkpoint_count(const std::optional<nb::bytes>& checkpoints) {
  return checkpoints ? int(checkpoints->size() / sizeof(int32_t)) : 0;
}

std::vector<std::string> kernels_of(const Plan& plan) {
  std::vector<std::string> kernels;
  for (const Dispatch& d : plan.dispatches)
    kernels.push_back(d.kernel);
  return kernels;
}

SegmentParams make_segment_params(
    int batch,
    int tokens,
    int key_heads,
    int value_heads,
    int key_dim,
    int value_dim,
    int conv_kernel,
    const std::string& decay_parameterization,
    const std::string& head_mapping,
    float norm_eps,
    bool has_mask) {
  SegmentParams p;
  p.set_shape({batch, tokens, key_heads, value_heads, key_dim, value_dim});
  p.conv_kernel = conv_kernel;
  p.decay_parameterization =
      parse_decay_parameterization(decay_parameterization);
  p.head_mapping = parse_head_mapping(head_mapping);
  p.norm_eps = norm_eps;
  p.has_mask = has_mask;
  return p;
}

// Every buffer run_plan returned, by its plan name.
nb::dict buffers_as_dict(const emulator::BufferOutputs& outputs) {
  nb::dict buffers;
  for (const auto& [buffer, bytes] : outputs)
    buffers[to_string(buffer)] = to_bytes(bytes);
  return buffers;
}

const char* to_string(BufferRole role) {
  switch (role) {
    case BufferRole::Input:
      return "input";
    case BufferRole::Output:
      return "output";
    case BufferRole::Scratch:
      return "scratch";
  }
  return "?";
}

nb::dict plan_as_dict(const Plan& plan) {
  nb::list dispatches;
  for (const Dispatch& d : plan.dispatches) {
    nb::dict entry;
    entry["stage"] = d.stage;
    entry["kernel"] = d.kernel;
    entry["threadgroups"] =
        nb::make_tuple(d.threadgroups.x, d.threadgroups.y, d.threadgroups.z);
    entry["threads_per_threadgroup"] = d.threads_per_threadgroup.count();
    entry["threadgroup_memory_bytes"] = d.threadgroup_memory_bytes;
    entry["bytes_moved"] = d.bytes_moved;
    entry["flops"] = d.flops;
    nb::list buffers;
    for (const Binding& binding : d.buffers) {
      buffers.append(nb::make_tuple(
          binding.index, to_string(binding.buffer), binding.written));
    }
    entry["buffers"] = buffers;
    entry["params_index"] = d.params_index;
    entry["params"] = nb::bytes(
        static_cast<const char*>(plan.params_data(d)), plan.params_size(d));
    entry["chunk"] = d.chunk
        ? nb::object(nb::make_tuple(d.chunk->index, d.chunk->chunk))
        : nb::none();
    dispatches.append(entry);
  }
  nb::dict sizes, roles;
  for (const BufferSpec& spec : plan.buffers) {
    sizes[to_string(spec.buffer)] = spec.bytes;
    roles[to_string(spec.buffer)] = to_string(spec.role);
  }
  nb::dict result;
  result["algorithm"] = to_string(plan.algorithm);
  result["kernel_params"] = nb::bytes(
      reinterpret_cast<const char*>(&plan.kernel_params),
      sizeof(plan.kernel_params));
  result["buffer_bytes"] = sizes;
  result["buffer_roles"] = roles;
  result["dispatches"] = dispatches;
  return result;
}

}  // namespace

NB_MODULE(_mlx_gated_delta_metal_emulator, m) {
  m.doc() =
      "The Metal kernels and dispatch plans of mlx_gated_delta, run on the CPU.";

  m.def(
      "run_core",
      [](nb::bytes q,
         nb::bytes k,
         nb::bytes v,
         nb::bytes g,
         nb::bytes beta,
         nb::bytes state,
         std::optional<nb::bytes> mask,
         int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         float scale,
         const std::string& head_mapping,
         bool normalize_qk,
         const std::string& algorithm,
         const std::string& dtype,
         int barrier_timeout_ms,
         const std::string& through_stage,
         std::optional<nb::bytes> checkpoints,
         std::optional<nb::bytes> parents,
         bool per_key_gates) {
        GatedDeltaParams params = make_params(
            batch,
            tokens,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            scale,
            head_mapping,
            normalize_qk,
            mask.has_value(),
            per_key_gates);
        params.checkpoint_count = checkpoint_count(checkpoints);
        params.has_tree = parents.has_value();
        Plan plan =
            make_plan(params, parse_algorithm(algorithm), parse_dtype(dtype));
        emulator::BufferInputs inputs{
            {PlanBuffer::Query, view(q)},
            {PlanBuffer::Key, view(k)},
            {PlanBuffer::Value, view(v)},
            {PlanBuffer::Gate, view(g)},
            {PlanBuffer::Beta, view(beta)},
            {PlanBuffer::StateIn, view(state)}};
        if (mask)
          inputs[PlanBuffer::Mask] = view(*mask);
        if (params.checkpoint_count > 0)
          inputs[PlanBuffer::Checkpoints] = view(*checkpoints);
        if (parents)
          inputs[PlanBuffer::Parents] = view(*parents);
        emulator::BufferOutputs outputs;
        {
          nb::gil_scoped_release release;
          outputs = emulator::run_plan(
              plan,
              inputs,
              std::chrono::milliseconds(barrier_timeout_ms),
              through_stage);
        }
        return std::make_tuple(
            to_bytes(outputs.at(PlanBuffer::Output)),
            to_bytes(outputs.at(PlanBuffer::StateOut)),
            std::string(to_string(plan.algorithm)),
            kernels_of(plan),
            buffers_as_dict(outputs));
      },
      nb::arg("q"),
      nb::arg("k"),
      nb::arg("v"),
      nb::arg("g"),
      nb::arg("beta"),
      nb::arg("state"),
      nb::arg("mask").none(),
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("scale"),
      nb::arg("head_mapping"),
      nb::arg("normalize_qk"),
      nb::arg("algorithm"),
      nb::arg("dtype"),
      nb::arg("barrier_timeout_ms"),
      nb::arg("through_stage") = "",
      nb::arg("checkpoints").none() = nb::none(),
      nb::arg("parents").none() = nb::none(),
      nb::arg("per_key_gates") = false,
      "Runs the Metal plan of one core call (g [B, T, Hv, Dk] with per_key_gates); returns (y bytes, state bytes, algorithm, kernels, "
      "{buffer name: bytes}); with through_stage, only the dispatches through that stage run "
      "and the dict holds the scratch buffers too. checkpoints: int32 bytes; the dict then "
      "holds checkpoint_states. parents: int32 bytes (tree verification).");

  m.def(
      "run_backward",
      [](nb::bytes q,
         nb::bytes k,
         nb::bytes v,
         nb::bytes g,
         nb::bytes beta,
         nb::bytes state,
         std::optional<nb::bytes> mask,
         nb::bytes y_cotangent,
         nb::bytes state_cotangent,
         int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         float scale,
         const std::string& head_mapping,
         bool normalize_qk,
         bool per_key_gates,
         const std::string& dtype,
         int barrier_timeout_ms,
         const std::string& through_stage,
         const std::string& algorithm) {
        GatedDeltaParams params = make_params(
            batch,
            tokens,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            scale,
            head_mapping,
            normalize_qk,
            mask.has_value(),
            per_key_gates);
        Plan plan = make_backward_plan(
            params, parse_dtype(dtype), parse_algorithm(algorithm));
        emulator::BufferInputs inputs{
            {PlanBuffer::Query, view(q)},
            {PlanBuffer::Key, view(k)},
            {PlanBuffer::Value, view(v)},
            {PlanBuffer::Gate, view(g)},
            {PlanBuffer::Beta, view(beta)},
            {PlanBuffer::StateIn, view(state)},
            {PlanBuffer::YCotangent, view(y_cotangent)},
            {PlanBuffer::StateCotangent, view(state_cotangent)}};
        if (mask)
          inputs[PlanBuffer::Mask] = view(*mask);
        emulator::BufferOutputs outputs;
        {
          nb::gil_scoped_release release;
          outputs = emulator::run_plan(
              plan,
              inputs,
              std::chrono::milliseconds(barrier_timeout_ms),
              through_stage);
        }
        return std::make_tuple(kernels_of(plan), buffers_as_dict(outputs));
      },
      nb::arg("q"),
      nb::arg("k"),
      nb::arg("v"),
      nb::arg("g"),
      nb::arg("beta"),
      nb::arg("state"),
      nb::arg("mask").none(),
      nb::arg("y_cotangent"),
      nb::arg("state_cotangent"),
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("scale"),
      nb::arg("head_mapping"),
      nb::arg("normalize_qk"),
      nb::arg("per_key_gates"),
      nb::arg("dtype"),
      nb::arg("barrier_timeout_ms"),
      nb::arg("through_stage") = "",
      nb::arg("algorithm") = "auto",
      "Runs the backward plan of one core call; returns (kernels, {buffer name: bytes}) with "
      "every gradient (dq, dk, dv, dg, d_decay, dbeta, dstate); with through_stage, only the "
      "dispatches through the first of that stage run and the dict holds the scratch too. "
      "algorithm: the backward's form (auto, recurrent or chunked).");

  m.def(
      "backward_plan",
      [](int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         const std::string& dtype,
         const std::string& head_mapping,
         bool normalize_qk,
         bool has_mask,
         bool per_key_gates,
         float scale,
         bool describe,
         const std::string& algorithm) -> nb::object {
        Plan plan = make_backward_plan(
            make_params(
                batch,
                tokens,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
                scale,
                head_mapping,
                normalize_qk,
                has_mask,
                per_key_gates),
            parse_dtype(dtype),
            parse_algorithm(algorithm));
        if (describe)
          return nb::str(
              describe_plan(plan, assumed_m_series_roofline()).c_str());
        return plan_as_dict(plan);
      },
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("dtype") = "float32",
      nb::arg("head_mapping") = "grouped",
      nb::arg("normalize_qk") = false,
      nb::arg("has_mask") = false,
      nb::arg("per_key_gates") = false,
      nb::arg("scale") = 1.0f,
      nb::arg("describe") = false,
      nb::arg("algorithm") = "auto",
      "The backward plan as a dict like plan()'s (each dispatch with its chunk, or None), or "
      "with describe=True as a table.");

  m.def(
      "plan",
      [](int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         const std::string& dtype,
         const std::string& algorithm,
         const std::string& head_mapping,
         bool normalize_qk,
         bool has_mask,
         float scale,
         int checkpoints,
         bool tree,
         bool per_key_gates) {
        GatedDeltaParams params = make_params(
            batch,
            tokens,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            scale,
            head_mapping,
            normalize_qk,
            has_mask,
            per_key_gates);
        params.checkpoint_count = checkpoints;
        params.has_tree = tree;
        return plan_as_dict(
            make_plan(params, parse_algorithm(algorithm), parse_dtype(dtype)));
      },
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("dtype") = "float32",
      nb::arg("algorithm") = "auto",
      nb::arg("head_mapping") = "grouped",
      nb::arg("normalize_qk") = false,
      nb::arg("has_mask") = false,
      nb::arg("scale") = 1.0f,
      nb::arg("checkpoints") = 0,
      nb::arg("tree") = false,
      nb::arg("per_key_gates") = false,
      "The plan (with `checkpoints` positions, with parents for `tree`, g [B, T, Hv, Dk] with `per_key_gates`): resolved algorithm, the kernel params' bytes, every buffer's size and the "
      "dispatches (stage, kernel, grid, threads, threadgroup memory, bindings, cost).");

  m.def(
      "describe_plan",
      [](int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         const std::string& dtype,
         const std::string& algorithm,
         const std::string& head_mapping,
         bool normalize_qk,
         bool has_mask,
         bool per_key_gates) {
        Plan plan = make_plan(
            make_params(
                batch,
                tokens,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
                1.0f,
                head_mapping,
                normalize_qk,
                has_mask,
                per_key_gates),
            parse_algorithm(algorithm),
            parse_dtype(dtype));
        return describe_plan(plan, assumed_m_series_roofline());
      },
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("dtype") = "float32",
      nb::arg("algorithm") = "auto",
      nb::arg("head_mapping") = "grouped",
      nb::arg("normalize_qk") = false,
      nb::arg("has_mask") = false,
      nb::arg("per_key_gates") = false,
      "A readable table of the plan against an assumed M-series roofline.");

  m.def(
      "run_segment",
      [](nb::bytes mixed,
         nb::bytes conv_weight,
         nb::bytes decay_parameter,
         nb::bytes dt_bias,
         nb::bytes norm_weight,
         nb::bytes conv_state,
         nb::bytes state,
         std::optional<nb::bytes> mask,
         int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         int conv_kernel,
         const std::string& decay_parameterization,
         const std::string& head_mapping,
         float norm_eps,
         const std::string& algorithm,
         const std::string& dtype,
         int barrier_timeout_ms,
         const std::string& through_stage,
         std::optional<nb::bytes> checkpoints) {
        SegmentParams params = make_segment_params(
            batch,
            tokens,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            conv_kernel,
            decay_parameterization,
            head_mapping,
            norm_eps,
            mask.has_value());
        params.checkpoint_count = checkpoint_count(checkpoints);
        Plan plan = make_segment_plan(
            params, parse_algorithm(algorithm), parse_dtype(dtype));
        emulator::BufferInputs inputs{
            {PlanBuffer::Mixed, view(mixed)},
            {PlanBuffer::ConvWeight, view(conv_weight)},
            {PlanBuffer::DecayParameter, view(decay_parameter)},
            {PlanBuffer::DtBias, view(dt_bias)},
            {PlanBuffer::NormWeight, view(norm_weight)},
            {PlanBuffer::ConvStateIn, view(conv_state)},
            {PlanBuffer::StateIn, view(state)}};
        if (mask)
          inputs[PlanBuffer::Mask] = view(*mask);
        if (params.checkpoint_count > 0)
          inputs[PlanBuffer::Checkpoints] = view(*checkpoints);
        emulator::BufferOutputs outputs;
        {
          nb::gil_scoped_release release;
          outputs = emulator::run_plan(
              plan,
              inputs,
              std::chrono::milliseconds(barrier_timeout_ms),
              through_stage);
        }
        return std::make_tuple(
            to_bytes(outputs.at(PlanBuffer::SegmentOutput)),
            to_bytes(outputs.at(PlanBuffer::ConvStateOut)),
            to_bytes(outputs.at(PlanBuffer::StateOut)),
            std::string(to_string(plan.algorithm)),
            kernels_of(plan),
            buffers_as_dict(outputs));
      },
      nb::arg("mixed"),
      nb::arg("conv_weight"),
      nb::arg("decay_parameter"),
      nb::arg("dt_bias"),
      nb::arg("norm_weight"),
      nb::arg("conv_state"),
      nb::arg("state"),
      nb::arg("mask").none(),
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("conv_kernel"),
      nb::arg("decay_parameterization"),
      nb::arg("head_mapping"),
      nb::arg("norm_eps"),
      nb::arg("algorithm"),
      nb::arg("dtype"),
      nb::arg("barrier_timeout_ms"),
      nb::arg("through_stage") = "",
      nb::arg("checkpoints").none() = nb::none(),
      "Runs the Metal plan of one fused segment call; returns (out bytes, conv_state bytes, "
      "state bytes, algorithm, kernels, {buffer name: bytes}); with through_stage, only the "
      "dispatches through that stage run and the dict holds the scratch buffers too.");

  m.def(
      "segment_plan",
      [](int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         int conv_kernel,
         const std::string& dtype,
         const std::string& algorithm,
         const std::string& decay_parameterization,
         const std::string& head_mapping,
         bool has_mask,
         bool describe,
         int checkpoints) -> nb::object {
        SegmentParams params = make_segment_params(
            batch,
            tokens,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            conv_kernel,
            decay_parameterization,
            head_mapping,
            1e-6f,
            has_mask);
        params.checkpoint_count = checkpoints;
        Plan plan = make_segment_plan(
            params, parse_algorithm(algorithm), parse_dtype(dtype));
        if (describe)
          return nb::str(
              describe_plan(plan, assumed_m_series_roofline()).c_str());
        return plan_as_dict(plan);
      },
      nb::arg("batch"),
      nb::arg("tokens"),
      nb::arg("key_heads"),
      nb::arg("value_heads"),
      nb::arg("key_dim"),
      nb::arg("value_dim"),
      nb::arg("conv_kernel"),
      nb::arg("dtype") = "float32",
      nb::arg("algorithm") = "auto",
      nb::arg("decay_parameterization") = "log_rate",
      nb::arg("head_mapping") = "grouped",
      nb::arg("has_mask") = false,
      nb::arg("describe") = false,
      nb::arg("checkpoints") = 0,
      "The fused segment's plan as a dict like plan()'s, or with describe=True as a table.");

  m.def(
      "run_kernel",
      [](const std::string& kernel,
         std::tuple<unsigned, unsigned, unsigned> threadgroups,
         std::tuple<unsigned, unsigned, unsigned> threads,
         size_t threadgroup_memory_bytes,
         nb::bytes data,
         int barrier_timeout_ms) {
        metal_emulator::GuardedBuffer buffer("data", data.size());
        std::memcpy(buffer.data(), data.c_str(), data.size());
        metal_emulator::Dispatch dispatch;
        dispatch.kernel = kernel;
        dispatch.buffers[0] = buffer.data();
        dispatch.threadgroups = {
            std::get<0>(threadgroups),
            std::get<1>(threadgroups),
            std::get<2>(threadgroups)};
        dispatch.threads_per_threadgroup = {
            std::get<0>(threads), std::get<1>(threads), std::get<2>(threads)};
        dispatch.threadgroup_memory_bytes = threadgroup_memory_bytes;
        {
          nb::gil_scoped_release release;
          metal_emulator::run_dispatch(
              dispatch, std::chrono::milliseconds(barrier_timeout_ms));
        }
        buffer.check_guards(kernel);
        return nb::bytes(
            reinterpret_cast<const char*>(buffer.data()), buffer.size());
      },
      nb::arg("kernel"),
      nb::arg("threadgroups"),
      nb::arg("threads"),
      nb::arg("threadgroup_memory_bytes"),
      nb::arg("data"),
      nb::arg("barrier_timeout_ms"),
      "Runs one kernel with a guarded copy of `data` bound at buffer(0); returns it afterwards.");
}
