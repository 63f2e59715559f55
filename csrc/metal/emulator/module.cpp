// _mlx_gated_delta_metal_emulator: the Metal plans and kernels run on the
// CPU, for tests. It binds the params and the plan as classes, and a handful
// of functions over them: build a plan, run a plan, run one kernel.
// tests/metal/metal_emulated.py composes them into the calls the tests make.
// Not part of the op's fast path; raw bytes in and out keep it free of MLX
// types.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>

#include "dispatch.h"
#include "executor.h"
#include "guarded_buffer.h"
#include "metal/plan/plan.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx_gated_delta;
using namespace mlx_gated_delta::metal;

namespace {

ActivationDtype parse_dtype(const std::string& name) {
  for (ActivationDtype dtype :
       {ActivationDtype::Float32,
        ActivationDtype::Float16,
        ActivationDtype::BFloat16}) {
    if (name == to_string(dtype))
      return dtype;
  }
  throw std::invalid_argument(
      "dtype must be float32, float16 or bfloat16, got " + name);
}

PlanBuffer parse_buffer(const std::string& name) {
  for (int n = 0; n < int(PlanBuffer::Count); ++n) {
    if (name == to_string(PlanBuffer(n)))
      return PlanBuffer(n);
  }
  throw std::invalid_argument(
      "metal emulator: no plan buffer is named " + name);
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

// The shape fields every params class binds, read and written by name.
template <typename Params>
void bind_shape(nb::class_<Params>& cls) {
  cls.def_rw("batch", &Params::batch)
      .def_rw("tokens", &Params::tokens)
      .def_rw("key_heads", &Params::key_heads)
      .def_rw("value_heads", &Params::value_heads)
      .def_rw("key_dim", &Params::key_dim)
      .def_rw("value_dim", &Params::value_dim);
}

template <typename Params>
Params with_shape(
    int batch,
    int tokens,
    int key_heads,
    int value_heads,
    int key_dim,
    int value_dim) {
  Params p;
  p.set_shape({batch, tokens, key_heads, value_heads, key_dim, value_dim});
  return p;
}

// An enum option of a params class, bound as its name.
template <typename Params, typename Enum, Enum Params::* member>
void bind_enum_name(
    nb::class_<Params>& cls,
    const char* name,
    Enum (*parse)(const std::string&)) {
  cls.def_prop_rw(
      name,
      [](const Params& p) { return std::string(to_string(p.*member)); },
      [parse](Params& p, const std::string& value) {
        p.*member = parse(value);
      });
}

// The plan as the tests read it: every dispatch (stage, kernel, grid,
// threads, threadgroup memory, bindings, scalar bytes, chunk, cost), the
// resolved algorithm, the core scalar block's bytes and every buffer's size
// and role.
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

// run_plan over buffers named as the plan names them; returns every buffer
// run_plan returned, by name.
nb::dict run_named(
    const Plan& plan,
    const std::map<std::string, nb::bytes>& named,
    int barrier_timeout_ms,
    const std::string& through_stage) {
  emulator::BufferInputs inputs;
  for (const auto& [name, data] : named) {
    inputs[parse_buffer(name)] = {
        reinterpret_cast<const std::byte*>(data.c_str()), data.size()};
  }
  emulator::BufferOutputs outputs;
  {
    nb::gil_scoped_release release;
    outputs = emulator::run_plan(
        plan,
        inputs,
        std::chrono::milliseconds(barrier_timeout_ms),
        through_stage);
  }
  nb::dict buffers;
  for (const auto& [buffer, bytes] : outputs) {
    buffers[to_string(buffer)] =
        nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  return buffers;
}

}  // namespace

NB_MODULE(_mlx_gated_delta_metal_emulator, m) {
  m.doc() =
      "The Metal kernels and dispatch plans of mlx_gated_delta, run on the CPU.";

  nb::class_<GatedDeltaParams> core(
      m, "CoreParams", "The params of one core call (core/core_params.h).");
  core.def(
      nb::new_(&with_shape<GatedDeltaParams>),
      "batch"_a,
      "tokens"_a,
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a);
  bind_shape(core);
  core.def_rw("scale", &GatedDeltaParams::scale)
      .def_rw("normalize_qk", &GatedDeltaParams::normalize_qk)
      .def_rw("has_mask", &GatedDeltaParams::has_mask)
      .def_rw("checkpoint_count", &GatedDeltaParams::checkpoint_count)
      .def_rw("has_tree", &GatedDeltaParams::has_tree)
      .def_rw("per_key_gates", &GatedDeltaParams::per_key_gates);
  bind_enum_name<
      GatedDeltaParams,
      HeadMapping,
      &GatedDeltaParams::head_mapping>(
      core, "head_mapping", &parse_head_mapping);

  nb::class_<SegmentParams> segment(
      m,
      "SegmentParams",
      "The params of one fused segment call (segment/segment_params.h).");
  segment.def(
      nb::new_(&with_shape<SegmentParams>),
      "batch"_a,
      "tokens"_a,
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a);
  bind_shape(segment);
  segment.def_rw("conv_kernel", &SegmentParams::conv_kernel)
      .def_rw("norm_eps", &SegmentParams::norm_eps)
      .def_rw("has_mask", &SegmentParams::has_mask)
      .def_rw("checkpoint_count", &SegmentParams::checkpoint_count)
      .def_rw("per_key_gates", &SegmentParams::per_key_gates)
      .def_prop_rw(
          "lower_bound",
          [](const SegmentParams& p) -> std::optional<float> {
            if (!p.gates.has_lower_bound)
              return std::nullopt;
            return p.gates.lower_bound;
          },
          [](SegmentParams& p, std::optional<float> bound) {
            p.gates.has_lower_bound = bound.has_value();
            p.gates.lower_bound = bound.value_or(0.0f);
          })
      .def_prop_rw(
          "allow_neg_eigval",
          [](const SegmentParams& p) { return p.gates.allow_neg_eigval; },
          [](SegmentParams& p, bool allow) {
            p.gates.allow_neg_eigval = allow;
          })
      .def_prop_rw(
          "output_gate",
          [](const SegmentParams& p) {
            return std::string(
                p.gates.output_gate == OutputGate::Sigmoid ? "sigmoid"
                                                           : "silu");
          },
          [](SegmentParams& p, const std::string& gate) {
            if (gate != "silu" && gate != "sigmoid")
              throw std::invalid_argument(
                  "output_gate must be 'silu' or 'sigmoid', got '" + gate +
                  "'");
            p.gates.output_gate =
                gate == "sigmoid" ? OutputGate::Sigmoid : OutputGate::Silu;
          });
  bind_enum_name<SegmentParams, HeadMapping, &SegmentParams::head_mapping>(
      segment, "head_mapping", &parse_head_mapping);
  bind_enum_name<
      SegmentParams,
      DecayParameterization,
      &SegmentParams::decay_parameterization>(
      segment, "decay_parameterization", &parse_decay_parameterization);

  nb::class_<Plan>(m, "Plan", "A Metal dispatch plan (metal/plan/plan.h).")
      .def_prop_ro(
          "algorithm",
          [](const Plan& plan) {
            return std::string(to_string(plan.algorithm));
          })
      .def_prop_ro(
          "kernels",
          [](const Plan& plan) {
            std::vector<std::string> kernels;
            for (const Dispatch& d : plan.dispatches)
              kernels.push_back(d.kernel);
            return kernels;
          })
      .def("as_dict", &plan_as_dict, "The plan's data as plain Python values.")
      .def(
          "describe",
          [](const Plan& plan) {
            return describe_plan(plan, assumed_m_series_roofline());
          },
          "A readable table of the plan against an assumed M-series roofline.")
      .def(
          "run",
          &run_named,
          "inputs"_a,
          "barrier_timeout_ms"_a,
          "through_stage"_a = "",
          "Runs the plan on the emulator over `inputs` ({buffer name: bytes}, "
          "exactly the plan's inputs); returns {buffer name: bytes} of its "
          "outputs, with through_stage only the dispatches through the first "
          "of that stage and the scratch buffers too.");

  m.def(
      "make_plan",
      [](const GatedDeltaParams& params,
         const std::string& algorithm,
         const std::string& dtype) {
        return make_plan(
            params, parse_algorithm(algorithm), parse_dtype(dtype));
      },
      "params"_a,
      "algorithm"_a = "auto",
      "dtype"_a = "float32");
  m.def(
      "make_segment_plan",
      [](const SegmentParams& params,
         const std::string& algorithm,
         const std::string& dtype) {
        return make_segment_plan(
            params, parse_algorithm(algorithm), parse_dtype(dtype));
      },
      "params"_a,
      "algorithm"_a = "auto",
      "dtype"_a = "float32");
  m.def(
      "make_backward_plan",
      [](const GatedDeltaParams& params,
         const std::string& dtype,
         const std::string& algorithm) {
        return make_backward_plan(
            params, parse_dtype(dtype), parse_algorithm(algorithm));
      },
      "params"_a,
      "dtype"_a = "float32",
      "algorithm"_a = "auto");

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
      "Runs one kernel with a guarded copy of `data` bound at buffer(0); "
      "returns it afterwards.");
}
