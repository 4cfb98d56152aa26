// The CPU row kernel that merges a chunk's logits into each row's softmax partial (row_stats.h),
// shared by chosen_logprob's and top_logprobs's cpu_rows.cpp (the CUDA one: stats_rows.cuh).
// Params: an op's launch record with logits, rows, cols, col0, tokens (null: none) and
// tokens_per_row, threshold (null: none), stats and logit_map. No torch header but at::vec.
#pragma once

#include "common/vec_math.h"
#include "vocab_parallel/logit_map.h"
#include "vocab_parallel/row_stats.h"

// Compiled once per ISA (common/cpu_isa.h): in its namespace.
namespace fused_rl_ops::CPU_CAPABILITY {

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

// The CPU kernel in double where fp64, else float, with p's logit map.
template <class Params>
void stats_rows_cpu(const Params& p, bool fp64) {
  with_acc_logit_map(p.logit_map, fp64,
                     [&](auto zero, const auto& logit) { stats_rows_cpu_kernel<decltype(zero)>(p, logit); });
}

}  // namespace fused_rl_ops::CPU_CAPABILITY
