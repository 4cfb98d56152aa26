// The row kernel that merges a chunk's logits into each row's softmax partial (row_stats.h), shared
// by chosen_logprob and top_logprobs, as their torch glue uses it: empty stats, and the CPU kernel
// (the CUDA one: stats_rows.cuh). Params: an op's launch record with logits, rows, cols, col0,
// tokens (null: none) and tokens_per_row, threshold (null: none), stats and logit_map.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <vector>

#include "common/vec_math.h"
#include "vocab_parallel/logit_map.h"
#include "vocab_parallel/row_stats.h"

namespace fused_rl_ops {

// Stats of no logits (partial_empty), shape [..., stats_column::chosen + tokens_per_row].
inline at::Tensor empty_stats(at::IntArrayRef rows, int64_t tokens_per_row, const at::TensorOptions& options) {
  std::vector<int64_t> shape = rows.vec();
  shape.push_back(stats_column::chosen + tokens_per_row);
  at::Tensor stats = at::zeros(shape, options);
  stats.select(-1, stats_column::max).fill_(-INFINITY);
  return stats;
}

// Logit: the PlainLogit or SoftcappedLogit of vocab_parallel/logit_map.h, in acc.
template <typename acc, class Params, class Logit>
void stats_rows_cpu_kernel(const Params& p, const Logit& logit) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* logits = static_cast<const acc*>(p.logits);
  auto* stats = static_cast<acc*>(p.stats);
  const int64_t N = p.rows, C = p.cols, col0 = p.col0, k = p.tokens_per_row;
  const int64_t* tokens = p.tokens;
  const auto* threshold = static_cast<const acc*>(p.threshold);
  const int64_t C_vec = C - C % Vec::size();
  const auto vlogit = logit.template as<Vec>();
  for (int64_t r = 0; r < N; ++r) {
    const acc* x = logits + r * C;
    const acc tau = threshold ? threshold[r] : acc(-INFINITY);
    Vec vmax(-INFINITY);
    for (int64_t c = 0; c < C_vec; c += Vec::size()) vmax = Math<Vec>::max(vmax, Vec::loadu(x + c));
    acc m = horizontal_max(vmax);
    for (int64_t c = C_vec; c < C; ++c) m = Math<acc>::max(m, x[c]);
    m = kept_max(logit(m), tau);  // the map is nondecreasing: the largest z is the map of the largest x
    const Vec vm(m), vtau(tau);
    Vec vs(0), vt(0);
    for (int64_t c = 0; c < C_vec; c += Vec::size()) stats_add(vlogit(Vec::loadu(x + c)), vm, vs, vt, vtau);
    acc s = horizontal_sum(vs), t = horizontal_sum(vt);
    for (int64_t c = C_vec; c < C; ++c) stats_add(logit(x[c]), m, s, t, tau);
    acc* row = stats + (stats_column::chosen + k) * r;
    stats_update_row(row, RowStats<acc>{m, s, t});
    if (k > 0) stats_pick_chosen(row + stats_column::chosen, tokens + k * r, k, 0, 1, x, col0, C, logit);
  }
}

// The CPU kernel in the accumulation dtype acc, with p's logit map.
template <class Params>
void stats_rows_cpu(const Params& p, at::ScalarType acc) {
  AT_DISPATCH_FLOATING_TYPES(acc, "stats_rows_cpu", [&] {
    with_logit_map<scalar_t>(p.logit_map, [&](const auto& logit) { stats_rows_cpu_kernel<scalar_t>(p, logit); });
  });
}

}  // namespace fused_rl_ops
