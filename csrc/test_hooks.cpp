// The test hooks of _mlx_gated_delta_ext (bindings.h): what only the tests
// call, to check the dispatch choices, the CPU kernels on guarded buffers,
// the chunked form's stages one by one, the thread pool, the segment's waves
// and the Metal library's messages on any machine.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

#include "bindings.h"
#include "core/activation_type.h"
#include "core/core_params.h"
#include "core/dispatch.h"
#include "cpu/backward.h"
#include "cpu/forward.h"
#include "cpu/segment.h"
#include "cpu/thread_pool.h"
#include "cpu/usable_cores.h"
#include "metal/library.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"
#include "segment/segment_op.h"
#include "validation/extents.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace mlx_gated_delta {

namespace {

constexpr int kGuardWords = 16;

// The parameters of a testing-only core call, from q [B, T, Hk, Dk],
// v [B, T, Hv, Dv], g ([B, T, Hv], or [B, T, Hv, Dk] per key channel) and
// the options.
GatedDeltaParams test_params(
    const mx::array& q,
    const mx::array& v,
    const mx::array& g,
    const std::optional<mx::array>& mask,
    std::optional<float> scale,
    const std::string& head_mapping,
    bool normalize_qk) {
  GatedDeltaParams p = shape_params(
      {q.shape(0), q.shape(1), q.shape(2), v.shape(2), q.shape(3), v.shape(3)});
  p.scale = scale.value_or(default_scale(p.key_dim));
  p.head_mapping = parse_head_mapping(head_mapping);
  p.normalize_qk = normalize_qk;
  p.has_mask = mask.has_value();
  p.per_key_gates = g.ndim() == 4;
  return p;
}

// A testing call's inputs as the CPU kernels read them, evaluated:
// row-contiguous, g and beta (the arrays at 3 and 4) in float32, the others
// as given, then the mask if any.
std::vector<mx::array> test_inputs(
    std::vector<mx::array> arrays, const std::optional<mx::array>& mask) {
  arrays[3] = mx::astype(arrays[3], mx::float32, mx::Device::cpu);
  arrays[4] = mx::astype(arrays[4], mx::float32, mx::Device::cpu);
  if (mask) {
    arrays.push_back(*mask);
  }
  for (auto& x : arrays) {
    x = mx::contiguous(x, false, mx::Device::cpu);
  }
  mx::eval(arrays);
  return arrays;
}

// An output buffer of `shape` followed by kGuardWords sentinel values, for
// a kernel run directly on it.
template <typename T>
struct Guarded {
  Guarded(mx::Shape shape, float sentinel)
      : shape(std::move(shape)),
        size(std::accumulate(
            this->shape.begin(),
            this->shape.end(),
            size_t(1),
            std::multiplies<size_t>())),
        values(size + kGuardWords, T(sentinel)) {}
  T* data() {
    return values.data();
  }
  // The output, then the kGuardWords values past its end.
  mx::array output(mx::Dtype dtype) const {
    return mx::array(values.begin(), shape, dtype);
  }
  mx::array tail(mx::Dtype dtype) const {
    return mx::array(values.begin() + size, {kGuardWords}, dtype);
  }

  mx::Shape shape;
  size_t size;
  std::vector<T> values;
};

// Runs the CPU kernel directly on output buffers followed by kGuardWords
// sentinel values each, and returns what lies past the end, so a test can
// prove no write lands past y or the state.
template <typename T>
nb::tuple run_guarded(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    std::vector<mx::array> in,
    float sentinel) {
  const mx::Dtype dtype = in[2].dtype();
  Guarded<T> y({p.batch, p.tokens, p.value_heads, p.value_dim}, sentinel);
  Guarded<float> state(
      {p.batch, p.value_heads, p.value_dim, p.key_dim}, sentinel);
  cpu::gated_delta_forward<T>(
      p,
      algorithm,
      cpu::contiguous_buffers<T>(
          p,
          in[0].data<T>(),
          in[1].data<T>(),
          in[2].data<T>(),
          in[3].data<float>(),
          in[4].data<float>(),
          p.has_mask ? in[6].data<bool>() : nullptr,
          in[5].data<float>(),
          y.data(),
          state.data()));
  return nb::make_tuple(
      y.output(dtype),
      state.output(mx::float32),
      y.tail(dtype),
      state.tail(mx::float32));
}

// The backward's run_guarded: the CPU backward on gradient buffers followed
// by sentinels. `in` holds q, k, v, g, beta, the state, the cotangents of y
// and of the final state, then the mask if any. Returns two dicts by
// gradient name (dq, dk, dv, dg, dgamma, dbeta, dstate): the gradients and
// the words past each one's end.
template <typename T>
nb::tuple run_backward_guarded(
    const GatedDeltaParams& p,
    Algorithm algorithm,
    std::vector<mx::array> in,
    float sentinel) {
  const mx::Dtype dtype = in[2].dtype();
  Guarded<T> dq(in[0].shape(), sentinel);
  Guarded<T> dk(in[1].shape(), sentinel);
  Guarded<T> dv(in[2].shape(), sentinel);
  Guarded<float> dg(in[3].shape(), sentinel);
  Guarded<float> dgamma(in[3].shape(), sentinel);
  Guarded<float> dbeta(in[4].shape(), sentinel);
  Guarded<float> dstate(in[5].shape(), sentinel);
  cpu::gated_delta_backward<T>(
      p,
      algorithm,
      cpu::BackwardBuffers<T>{
          in[0].data<T>(),
          in[1].data<T>(),
          in[2].data<T>(),
          in[3].data<float>(),
          in[4].data<float>(),
          p.has_mask ? in[8].data<bool>() : nullptr,
          in[5].data<float>(),
          in[6].data<T>(),
          in[7].data<float>(),
          dq.data(),
          dk.data(),
          dv.data(),
          dg.data(),
          dgamma.data(),
          dbeta.data(),
          dstate.data()});
  nb::dict gradients, tails;
  for (auto [name, buffer] :
       {std::pair{"dq", &dq}, std::pair{"dk", &dk}, std::pair{"dv", &dv}}) {
    gradients[name] = buffer->output(dtype);
    tails[name] = buffer->tail(dtype);
  }
  for (auto [name, buffer] :
       {std::pair{"dg", &dg},
        std::pair{"dgamma", &dgamma},
        std::pair{"dbeta", &dbeta},
        std::pair{"dstate", &dstate}}) {
    gradients[name] = buffer->output(mx::float32);
    tails[name] = buffer->tail(mx::float32);
  }
  return nb::make_tuple(gradients, tails);
}

// A traced call's arrays as the CPU kernels read them, evaluated: each
// row-contiguous float32, then the mask, if any, as bool.
std::vector<mx::array> float32_inputs(
    std::vector<mx::array> arrays, const std::optional<mx::array>& mask) {
  for (auto& x : arrays) {
    x = mx::contiguous(
        mx::astype(x, mx::float32, mx::Device::cpu), false, mx::Device::cpu);
  }
  if (mask) {
    arrays.push_back(mx::contiguous(
        mx::astype(*mask, mx::bool_, mx::Device::cpu), false, mx::Device::cpu));
  }
  mx::eval(arrays);
  return arrays;
}

// Runs the float32 chunked form on problem (batch, head) alone and returns
// every stage's output by name (cpu::ChunkedTrace), with its y rows [T, Dv]
// and final state [Dv, Dk].
nb::dict trace_chunked(
    const GatedDeltaParams& p,
    const std::vector<mx::array>& in,
    int batch,
    int head) {
  if (batch < 0 || batch >= p.batch || head < 0 || head >= p.value_heads) {
    throw std::invalid_argument("no such batch row or value head");
  }
  std::vector<float> y(
      size_t(p.batch) * p.tokens * p.value_heads * p.value_dim);
  std::vector<float> state(
      size_t(p.batch) * p.value_heads * p.value_dim * p.key_dim);
  const cpu::CoreBuffers<float> buffers = cpu::contiguous_buffers<float>(
      p,
      in[0].data<float>(),
      in[1].data<float>(),
      in[2].data<float>(),
      in[3].data<float>(),
      in[4].data<float>(),
      p.has_mask ? in[6].data<bool>() : nullptr,
      in[5].data<float>(),
      y.data(),
      state.data());
  const cpu::ChunkedTrace t =
      cpu::trace_chunked_stages(p, buffers, batch, head);
  const int chunks = t.chunks, L = int(kChunkSize), dk = p.key_dim,
            dv = p.value_dim;
  auto f32 = [](const std::vector<float>& values, mx::Shape shape) {
    return mx::array(values.begin(), std::move(shape), mx::float32);
  };
  nb::dict out;
  out["q"] = f32(t.q, {chunks, L, dk});
  out["k"] = f32(t.k, {chunks, L, dk});
  // Per-key gates: one cumulative log decay and last wipe per channel.
  const mx::Shape gate_shape =
      p.per_key_gates ? mx::Shape{chunks, L, dk} : mx::Shape{chunks, L};
  out["log_cumsum"] = f32(t.log_cumsum, gate_shape);
  out["last_wipe"] = mx::array(t.last_wipe.begin(), gate_shape, mx::int32);
  out["beta_effective"] = f32(t.beta, {chunks, L});
  out["k_gram"] = f32(t.k_gram, {chunks, L, L});
  out["qk"] = f32(t.qk, {chunks, L, L});
  out["kkt_inverse"] = f32(t.inverse, {chunks, L, L});
  out["w"] = f32(t.w, {chunks, L, dk});
  out["u"] = f32(t.u, {chunks, L, dv});
  out["corrected"] = f32(t.corrected, {chunks, L, dv});
  out["output_inter"] = f32(t.output_inter, {chunks, L, dv});
  out["exit_states"] = f32(t.state, {chunks, dv, dk});
  // The problem's own rows of y and its final state.
  std::vector<float> y_head(size_t(p.tokens) * dv);
  for (int token = 0; token < p.tokens; ++token) {
    const float* row = y.data() +
        ((size_t(batch) * p.tokens + token) * p.value_heads + head) * dv;
    std::copy(row, row + dv, y_head.begin() + size_t(token) * dv);
  }
  out["y"] = f32(y_head, {p.tokens, dv});
  const float* final_state =
      state.data() + (size_t(batch) * p.value_heads + head) * dv * dk;
  out["state"] = mx::array(final_state, {dv, dk}, mx::float32);
  return out;
}

// Runs the float32 chunked backward on problem (batch, head) alone and
// returns what each of its stages leaves by name (cpu::ChunkedBackwardTrace).
// `in` holds q, k, v, g, beta, the state, the cotangents of y and of the
// final state, then the mask if any, all float32 but the mask.
nb::dict trace_chunked_backward(
    const GatedDeltaParams& p,
    const std::vector<mx::array>& in,
    int batch,
    int head) {
  if (batch < 0 || batch >= p.batch || head < 0 || head >= p.value_heads) {
    throw std::invalid_argument("no such batch row or value head");
  }
  std::vector<float> dq(in[0].size()), dk(in[1].size()), dv(in[2].size());
  std::vector<float> dg(in[3].size()), dgamma(in[3].size());
  std::vector<float> dbeta(in[4].size()), dstate(in[5].size());
  const cpu::ChunkedBackwardTrace t = cpu::trace_chunked_backward_stages(
      p,
      cpu::BackwardBuffers<float>{
          in[0].data<float>(),
          in[1].data<float>(),
          in[2].data<float>(),
          in[3].data<float>(),
          in[4].data<float>(),
          p.has_mask ? in[8].data<bool>() : nullptr,
          in[5].data<float>(),
          in[6].data<float>(),
          in[7].data<float>(),
          dq.data(),
          dk.data(),
          dv.data(),
          dg.data(),
          dgamma.data(),
          dbeta.data(),
          dstate.data()},
      batch,
      head);
  const int chunks = t.chunks, L = int(kChunkSize);
  const int key_dim = p.key_dim, value_dim = p.value_dim;
  // A stage's array, zeros where no chunk ran it (every chunk recurrent).
  auto f32 = [](std::vector<float> values, mx::Shape shape) {
    values.resize(std::accumulate(
        shape.begin(), shape.end(), size_t(1), std::multiplies<size_t>()));
    return mx::array(values.begin(), std::move(shape), mx::float32);
  };
  const mx::Shape value_rows{chunks, L, value_dim},
      key_rows{chunks, L, key_dim};
  const mx::Shape gate_rows{chunks, L};
  nb::dict out;
  out["output_d_corrected"] = f32(t.output_d_corrected, value_rows);
  out["output_dq"] = f32(t.output_dq, key_rows);
  out["output_dk"] = f32(t.output_dk, key_rows);
  out["carry_d_corrected"] = f32(t.carry_d_corrected, value_rows);
  out["carry_dw"] = f32(t.carry_dw, key_rows);
  out["carry_dq"] = f32(t.carry_dq, key_rows);
  out["carry_dk"] = f32(t.carry_dk, key_rows);
  out["w_u_dt"] = f32(t.w_u_dt, {chunks, L, L});
  out["w_u_dk"] = f32(t.w_u_dk, key_rows);
  out["w_u_dbeta"] = f32(t.w_u_dbeta, gate_rows);
  out["kkt_dk"] = f32(t.kkt_dk, key_rows);
  out["kkt_dbeta"] = f32(t.kkt_dbeta, gate_rows);
  out["dg"] = f32(t.dg, p.per_key_gates ? key_rows : gate_rows);
  return out;
}

// Binds hook(shape) as name(batch, tokens, key_heads, value_heads, key_dim,
// value_dim): the hooks that answer a question about a call's shape.
template <typename Hook>
void def_shape_hook(
    nb::module_& m, const char* name, Hook hook, const char* doc) {
  m.def(
      name,
      [hook](
          int batch,
          int tokens,
          int key_heads,
          int value_heads,
          int key_dim,
          int value_dim) {
        return hook(ProblemShape{
            batch, tokens, key_heads, value_heads, key_dim, value_dim});
      },
      "batch"_a,
      "tokens"_a,
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a,
      doc);
}

}  // namespace

void bind_test_hooks(nb::module_& m) {
  m.def(
      "supports_simd_delta",
      [](int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         int simd_width) {
        return supports_simd_delta(
            shape_params({1, 1, key_heads, value_heads, key_dim, value_dim}),
            simd_width);
      },
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a,
      "simd_width"_a);
  m.def(
      "uses_chunk_k_gram_k128",
      [](int key_heads, int value_heads, int key_dim, int value_dim) {
        return uses_chunk_k_gram_k128(
            shape_params({1, 1, key_heads, value_heads, key_dim, value_dim}));
      },
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a);
  def_shape_hook(
      m,
      "validate_launch_extents",
      [](const ProblemShape& shape) {
        validate_launch_extents(shape_params(shape));
      },
      "Testing only: raises where one of the core's buffers at this shape "
      "would not fit a 32-bit kernel index.");
  def_shape_hook(
      m,
      "resolve_cpu_algorithm",
      [](const ProblemShape& shape) {
        return std::string(
            to_string(resolve_cpu_algorithm(shape_params(shape))));
      },
      "Testing only: the algorithm 'auto' runs on the CPU for this shape.");

  m.def(
      "resolve_cpu_backward_algorithm",
      [](int batch,
         int tokens,
         int key_heads,
         int value_heads,
         int key_dim,
         int value_dim,
         bool per_key_gates) {
        GatedDeltaParams p = shape_params(
            {batch, tokens, key_heads, value_heads, key_dim, value_dim});
        p.per_key_gates = per_key_gates;
        return std::string(to_string(resolve_cpu_backward_algorithm(p)));
      },
      "batch"_a,
      "tokens"_a,
      "key_heads"_a,
      "value_heads"_a,
      "key_dim"_a,
      "value_dim"_a,
      "per_key_gates"_a = false);
  m.attr("CHUNKED_BACKWARD_MIN_TOKENS") = kChunkedBackwardMinTokens;

  // The Metal library's test hook and failure message (metal/library.h),
  // bound so that tests check them on machines without an Apple GPU.
  m.def(
      "metal_library_source",
      [](const std::string& embedded) {
        return metal::library_source(embedded.c_str());
      },
      "embedded"_a);
  m.def(
      "metal_library_failure_message",
      &metal::library_failure_message,
      "compiler_output"_a);

  m.def(
      "run_core_guarded",
      [](const mx::array& q,
         const mx::array& k,
         const mx::array& v,
         const mx::array& g,
         const mx::array& beta,
         const mx::array& state,
         const std::optional<mx::array>& mask,
         std::optional<float> scale,
         const std::string& head_mapping,
         bool normalize_qk,
         const std::string& algorithm,
         float sentinel) {
        GatedDeltaParams p =
            test_params(q, v, g, mask, scale, head_mapping, normalize_qk);
        Algorithm a = parse_algorithm(algorithm);
        if (a == Algorithm::Auto) {
          a = resolve_cpu_algorithm(p);
        }
        std::vector<mx::array> in =
            test_inputs({q, k, v, g, beta, state}, mask);
        return with_activation_type(v.dtype(), "v", [&](auto type) {
          return run_guarded<decltype(type)>(p, a, in, sentinel);
        });
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "mask"_a.none(),
      "scale"_a.none(),
      "head_mapping"_a,
      "normalize_qk"_a,
      "algorithm"_a,
      "sentinel"_a,
      "Testing only: runs the CPU kernel with sentinel words past each output "
      "and returns (y, state, y_tail, state_tail).");

  m.def(
      "run_core_backward_guarded",
      [](const mx::array& q,
         const mx::array& k,
         const mx::array& v,
         const mx::array& g,
         const mx::array& beta,
         const mx::array& state,
         const mx::array& y_cotangent,
         const mx::array& state_cotangent,
         const std::optional<mx::array>& mask,
         std::optional<float> scale,
         const std::string& head_mapping,
         bool normalize_qk,
         const std::string& algorithm,
         float sentinel) {
        GatedDeltaParams p =
            test_params(q, v, g, mask, scale, head_mapping, normalize_qk);
        Algorithm a = parse_algorithm(algorithm);
        if (a == Algorithm::Auto) {
          a = resolve_cpu_backward_algorithm(p);
        }
        std::vector<mx::array> in = test_inputs(
            {q,
             k,
             v,
             g,
             beta,
             state,
             mx::astype(y_cotangent, v.dtype(), mx::Device::cpu),
             mx::astype(state_cotangent, mx::float32, mx::Device::cpu)},
            mask);
        return with_activation_type(v.dtype(), "v", [&](auto type) {
          return run_backward_guarded<decltype(type)>(p, a, in, sentinel);
        });
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "y_cotangent"_a,
      "state_cotangent"_a,
      "mask"_a.none(),
      "scale"_a.none(),
      "head_mapping"_a,
      "normalize_qk"_a,
      "algorithm"_a,
      "sentinel"_a,
      "Testing only: runs the CPU backward with sentinel words past each "
      "gradient and returns (gradients, tails), dicts by gradient name.");

  // The CPU thread pool on its own: every kernel relies on parallel_for
  // running each index exactly once, also while other streams call it. A
  // task that sleeps keeps the pool busy long enough for callers from
  // several Python threads to overlap.
  m.def(
      "run_cpu_parallel_for",
      [](int count, int task_sleep_us) {
        std::vector<std::atomic<int>> calls(std::max(count, 0));
        std::atomic<int> strays{0};
        {
          nb::gil_scoped_release release;
          cpu::parallel_for(count, [&](int i) {
            if (i >= 0 && i < count) {
              calls[i].fetch_add(1);
            } else {
              strays.fetch_add(1);
            }
            if (task_sleep_us > 0) {
              std::this_thread::sleep_for(
                  std::chrono::microseconds(task_sleep_us));
            }
          });
        }
        std::vector<int> counts(calls.begin(), calls.end());
        return nb::make_tuple(counts, strays.load());
      },
      "count"_a,
      "task_sleep_us"_a = 0,
      "Testing only: runs the CPU thread pool's parallel_for(count) with a "
      "task that counts its calls (then sleeps task_sleep_us), and returns "
      "(calls per index, calls with an index outside [0, count)).");

  // The pool's answer to a stalled worker. First jobs in which a worker's
  // task sleeps 50 ms (as a worker preempted inside a task holds the caller
  // up) while the caller's tasks wait, up to 40 ms, only for a worker to
  // join, so that the caller's own share always ends first, until a worker
  // has joined one; then at once a job that states a small work (a decode
  // step's) but whose tasks sleep 200 us, long enough for any woken worker to
  // join. Returns (whether a worker joined the first kind, how many threads
  // ran the second).
  m.def(
      "cpu_pool_threads_after_stall",
      [](int count) {
        // The Python objects are made after the GIL is taken back.
        std::optional<nb::gil_scoped_release> release(std::in_place);
        const auto caller = std::this_thread::get_id();
        bool worker_joined = false;
        for (int attempt = 0; attempt < 50 && !worker_joined; ++attempt) {
          std::atomic<bool> joined{false};
          cpu::parallel_for(count, [&](int) {
            if (std::this_thread::get_id() == caller) {
              const auto give_up = std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(40);
              while (!joined.load() &&
                     std::chrono::steady_clock::now() < give_up) {
                std::this_thread::yield();
              }
            } else {
              joined.store(true);
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
            }
          });
          worker_joined = joined.load();
        }
        // 64K multiply-adds a task: enough to ask for every thread of a
        // small machine, far below a millisecond of work in all.
        constexpr int64_t kSmallTaskWork = 64 * 1024;
        std::mutex mutex;
        std::vector<std::thread::id> threads;
        cpu::parallel_for(count, kSmallTaskWork, [&](int) {
          {
            std::lock_guard<std::mutex> lock(mutex);
            const auto self = std::this_thread::get_id();
            if (std::find(threads.begin(), threads.end(), self) ==
                threads.end()) {
              threads.push_back(self);
            }
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        });
        release.reset();
        return nb::make_tuple(worker_joined, threads.size());
      },
      "count"_a,
      "Testing only: after a job held up by a sleeping worker, how many "
      "threads run a small job: (whether a worker joined, threads).");

  m.def(
      "set_segment_as_ops_on_every_stream",
      &set_segment_as_ops_on_every_stream,
      "on"_a,
      "Testing only: run gated_delta_segment as MLX ops around the core op on "
      "every stream instead of its primitive.");

  m.def(
      "cpu_pool_threads_for_work",
      &cpu::threads_for_work,
      "work"_a,
      "Testing only: how many threads the CPU pool asks for, for a job of "
      "`work` multiply-adds.");

  m.def(
      "exchange_segment_wave_bytes",
      &cpu::exchange_segment_wave_bytes,
      "bytes"_a,
      "Testing only: sets the CPU segment's wave budget (bytes of one wave's "
      "float32 q, k, v and y) and returns the one before.");
  def_shape_hook(
      m,
      "segment_wave_key_heads",
      [](const ProblemShape& shape) {
        SegmentParams p;
        p.set_shape(shape);
        return cpu::segment_wave_key_heads(p, cpu::thread_count());
      },
      "Testing only: the key heads of one wave of the CPU segment (grouped "
      "heads) on this pool, under the present budget.");

  m.def(
      "cpus_of_cgroup_cpu_max",
      &cpu::cpus_of_cgroup_cpu_max,
      "text"_a,
      "Testing only: the CPUs a cgroup v2 cpu.max file's text grants, "
      "rounded up; None for 'max' or malformed text.");
  m.def(
      "cpus_of_cfs_quota",
      &cpu::cpus_of_cfs_quota,
      "quota"_a,
      "period"_a,
      "Testing only: the CPUs cgroup v1's cpu.cfs_quota_us and "
      "cpu.cfs_period_us texts grant, rounded up; None for -1 (no limit).");

  m.def(
      "trace_cpu_chunked_stages",
      [](const mx::array& q,
         const mx::array& k,
         const mx::array& v,
         const mx::array& g,
         const mx::array& beta,
         const mx::array& state,
         const std::optional<mx::array>& mask,
         std::optional<float> scale,
         const std::string& head_mapping,
         bool normalize_qk,
         int batch,
         int head) {
        GatedDeltaParams p =
            test_params(q, v, g, mask, scale, head_mapping, normalize_qk);
        return trace_chunked(
            p, float32_inputs({q, k, v, g, beta, state}, mask), batch, head);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "mask"_a.none(),
      "scale"_a.none(),
      "head_mapping"_a,
      "normalize_qk"_a,
      "batch"_a,
      "head"_a,
      "Testing only: runs the float32 CPU chunked form on one (batch, value "
      "head) and returns every stage's output by name, chunk by chunk.");

  m.def(
      "trace_cpu_chunked_backward_stages",
      [](const mx::array& q,
         const mx::array& k,
         const mx::array& v,
         const mx::array& g,
         const mx::array& beta,
         const mx::array& state,
         const mx::array& y_cotangent,
         const mx::array& state_cotangent,
         const std::optional<mx::array>& mask,
         std::optional<float> scale,
         const std::string& head_mapping,
         bool normalize_qk,
         int batch,
         int head) {
        GatedDeltaParams p =
            test_params(q, v, g, mask, scale, head_mapping, normalize_qk);
        const std::vector<mx::array> in = float32_inputs(
            {q, k, v, g, beta, state, y_cotangent, state_cotangent}, mask);
        return trace_chunked_backward(p, in, batch, head);
      },
      "q"_a,
      "k"_a,
      "v"_a,
      "g"_a,
      "beta"_a,
      "state"_a,
      "y_cotangent"_a,
      "state_cotangent"_a,
      "mask"_a.none(),
      "scale"_a.none(),
      "head_mapping"_a,
      "normalize_qk"_a,
      "batch"_a,
      "head"_a,
      "Testing only: runs the float32 CPU chunked backward on one (batch, "
      "value head) and returns what each stage leaves by name, chunk by "
      "chunk.");
}

}  // namespace mlx_gated_delta
