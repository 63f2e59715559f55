// The plan's cost model (plan.h, describe_plan): each dispatch's bytes moved
// and flops against an assumed roofline.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>

#include "metal/plan/plan.h"

namespace mlx_gated_delta::metal {

Roofline assumed_m_series_roofline() {
  // Apple M3 Max (40-core GPU), the figures assumed on paper: 400 GB/s of
  // unified-memory bandwidth and about 14 TFLOP/s float32 (40 cores x 128 ALUs
  // x 2 flops x ~1.4 GHz). Not measured here: there is no Apple GPU.
  return {
      "Apple M3 Max (40-core GPU), assumed: 400 GB/s, 14.3 TFLOP/s float32",
      400e9,
      14.3e12};
}

std::string describe_plan(const Plan& plan, const Roofline& roofline) {
  const GatedDeltaKernelParams& k = plan.kernel_params;
  std::ostringstream out;
  char line[512];
  out << (plan.backward ? "backward plan: " : "plan: ")
      << to_string(plan.algorithm) << ", " << to_string(plan.dtype)
      << " activations, B=" << k.batch << " T=" << k.tokens
      << " Hk=" << k.key_heads << " Hv=" << k.value_heads << " Dk=" << k.key_dim
      << " Dv=" << k.value_dim
      << (k.head_mapping == 0 ? " grouped" : " interleaved")
      << (k.normalize_qk ? " normalize_qk" : "") << (k.has_mask ? " mask" : "")
      << "\n";
  out << "roofline: " << roofline.chip << "\n";
  out << "dispatches: " << plan.dispatches.size() << "\n";
  // The dispatches of a per-chunk stage (the backward walks its chunks one
  // dispatch each) share one row: "stage xN", their sums.
  struct Row {
    const Dispatch* first;
    unsigned count = 0;
    double bytes = 0, flops = 0, t_mem = 0, t_flop = 0, time = 0;
  };
  std::vector<Row> rows;
  for (const Dispatch& d : plan.dispatches) {
    auto row = std::find_if(rows.begin(), rows.end(), [&](const Row& r) {
      return d.chunk && r.first->chunk && r.first->stage == d.stage;
    });
    if (row == rows.end()) {
      rows.push_back({&d});
      row = rows.end() - 1;
    }
    const double t_mem = d.bytes_moved / roofline.bytes_per_second * 1e6;
    const double t_flop = d.flops / roofline.flops_per_second * 1e6;
    ++row->count;
    row->bytes += d.bytes_moved;
    row->flops += d.flops;
    row->t_mem += t_mem;
    row->t_flop += t_flop;
    row->time += std::max(t_mem, t_flop);
  }
  std::snprintf(
      line,
      sizeof(line),
      "%-30s %-48s %18s %8s %9s %10s %11s %10s %10s %6s\n",
      "stage",
      "kernel",
      "threadgroups",
      "threads",
      "tg bytes",
      "MB moved",
      "GFLOP",
      "t_mem us",
      "t_flop us",
      "bound");
  out << line;
  double total_bytes = 0, total_flops = 0, total_time = 0;
  for (const Row& row : rows) {
    const Dispatch& d = *row.first;
    char groups[64];
    std::snprintf(
        groups,
        sizeof(groups),
        "%ux%ux%u",
        d.threadgroups.x,
        d.threadgroups.y,
        d.threadgroups.z);
    std::string stage = d.stage;
    if (row.count > 1)
      stage += " x" + std::to_string(row.count);
    std::snprintf(
        line,
        sizeof(line),
        "%-30s %-48s %18s %8llu %9zu %10.2f %11.3f %10.1f %10.1f %6s\n",
        stage.c_str(),
        d.kernel.c_str(),
        groups,
        (unsigned long long)d.threads_per_threadgroup.count(),
        d.threadgroup_memory_bytes,
        row.bytes / 1e6,
        row.flops / 1e9,
        row.t_mem,
        row.t_flop,
        row.t_mem > row.t_flop ? "memory" : "flops");
    out << line;
    total_bytes += row.bytes;
    total_flops += row.flops;
    total_time += row.time;
  }
  uint64_t scratch = 0;
  for (const BufferSpec& spec : plan.buffers) {
    if (spec.role == BufferRole::Scratch)
      scratch += spec.bytes;
  }
  std::snprintf(
      line,
      sizeof(line),
      "total: %.2f MB moved, %.3f GFLOP; roofline time (sum over stages of "
      "max(memory, flops)) %.1f us; scratch %.1f MiB\n",
      total_bytes / 1e6,
      total_flops / 1e9,
      total_time,
      scratch / 1048576.0);
  out << line;
  return out.str();
}

}  // namespace mlx_gated_delta::metal
