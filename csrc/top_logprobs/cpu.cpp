// top_logprobs, CPU: the chunk loop with ATen GEMMs (vocab_parallel/cpu_gemms.h), the shared stats
// kernel and the top-ids row kernel, on pieces of rows handed to the threads as they come free.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "common/vec_math.h"
#include "top_logprobs/entry.h"
#include "top_logprobs/top_ids.h"
#include "vocab_parallel/cpu_gemms.h"
#include "vocab_parallel/stats_rows.h"

namespace fused_rl_ops::top_logprobs {
namespace {

// Gives each logit of a row, with its global id, to the row's top of top_width (top_ids.h), in
// column order: once full, a logit equal to its last entry comes after it (a higher id), so only a
// larger one can enter.
template <typename acc, class Logit>
void top_ids_rows_cpu(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  auto* values = static_cast<acc*>(p.top);
  const int64_t N = p.rows, C = p.cols, K = p.top_width, col0 = p.col0;
  const int64_t C_vec = C - C % Vec::size();
  const int no_lane = (1 << Vec::size()) - 1;
  const auto vlogit = logit.template as<Vec>();
  alignas(64) acc lanes[Vec::size()];
  for (int64_t r = 0; r < N; ++r) {
    const acc* x = logits + r * C;
    acc* top = values + r * K;
    int64_t* ids = p.top_ids + r * K;
    for (int64_t c = 0; c < C_vec; c += Vec::size()) {
      const Vec z = vlogit(Vec::loadu(x + c));
      // A placeholder root (id kNoId) takes a -inf logit too.
      if (ids[0] != kNoId && (z > Vec(top[0])).zero_mask() == no_lane) continue;
      z.store(lanes);
      for (int j = 0; j < Vec::size(); ++j) top_ids_push(top, ids, K, lanes[j], col0 + c + j);
    }
    for (int64_t c = C_vec; c < C; ++c) top_ids_push(top, ids, K, logit(x[c]), col0 + c);
  }
}

struct CpuKernels : CpuGemms {
  // The shared stats kernel, then the top over the same piece of rows (in cache).
  static void stats_top_ids_rows(const Params& p, at::ScalarType acc) {
    stats_rows_cpu(p, acc);
    AT_DISPATCH_FLOATING_TYPES(acc, "top_logprobs_top_ids_cpu", [&] {
      with_logit_map<scalar_t>(p.logit_map, [&](const auto& logit) { top_ids_rows_cpu<scalar_t>(p, logit); });
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CPU, m) { m.impl("top_logprobs_stats", &stats<CpuKernels>); }

}  // namespace fused_rl_ops::top_logprobs
