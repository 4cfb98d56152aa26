// chosen_logprob's per-row math beyond the row's softmax partial (vocab_parallel/row_stats.h), shared
// by the CPU and CUDA kernels: the shards' partials combined, and the logit gradients. The backward
// works with z - m and log s apart, so no gradient needs a difference of large numbers (lse - entropy
// rounded at |lse| would cost the entropy gradient ulp(|lse|) of accuracy).
#pragma once

#include <cstdint>

#include "common/math.h"
#include "vocab_parallel/row_stats.h"

namespace fused_rl_ops::chosen_logprob {

// What combine_row makes of the shards' partials (stats_column): m, log s, entropy, the k chosen logits.
namespace combined_column {
enum : int { row_max, log_sum, entropy, chosen };
}

// Position r of partials [ranks, N, columns] (one row of stats per shard, columns =
// stats_column::chosen + k) -> row r of out (combined_column): lse = m + log s; the chosen logits
// summed (only the owning shard's are nonzero).
template <typename T>
FRL_HD void combine_row(const T* partials, int64_t ranks, int64_t N, int64_t r, int64_t columns, T* out) {
  RowStats<T> row = partial_empty<RowStats<T>>();
  T* o = out + r * columns;
  for (int64_t c = stats_column::chosen; c < columns; ++c) o[c] = 0;
  for (int64_t k = 0; k < ranks; ++k) {
    const T* q = partials + (k * N + r) * columns;
    stats_merge(row, RowStats<T>{q[stats_column::max], q[stats_column::sum], q[stats_column::ent]});
    for (int64_t c = stats_column::chosen; c < columns; ++c) o[c] += q[c];
  }
  o[combined_column::row_max] = row.max;
  o[combined_column::log_sum] = Math<T>::log(row.sum);
  o[combined_column::entropy] = stats_entropy(row);
}

// d(grad_logprob * logprob + grad_entropy * entropy) / dz for a column that is not the chosen
// token, from the logit z, the row max m, the row's log-sum l = lse - m = log s, and l - entropy =
// sum p (z - m): with p = exp(z - m - l),
//   -p (gl + ge (z - m - (l - entropy))) = -p (gl + ge (z - sum p z)).  The chosen column adds gl.
// p = 0 (a -inf logit, or one far below the rest) passes no gradient: written out, the entropy term
// is inf for a -inf logit and 0 * inf NaN. A NaN p (a NaN row) stays NaN. Under the sampler's
// filter, l and the entropy are the kept set's and a logit it drops (z < tau) passes none.
template <typename T>
FRL_HD T logit_grad(T z, T m, T tau, T log_sum, T log_sum_minus_entropy, T gl, T ge) {
  const T z_minus_max = z - m;
  const T p = Math<T>::exp(z_minus_max - log_sum);
  return Math<T>::select((p == T(0)) | (z < tau), T(0),
                         T(0) - p * (gl + ge * (z_minus_max - log_sum_minus_entropy)));
}

// A position's k entries (k tokens scored under one distribution; grad_rows): their upstream logprob
// gradients gl [k] (0 for entries that pass none) summed in entry order, the G every column's
// probability term takes: d(sum_j gl_j logprob_j) / dz_v = sum_j gl_j 1[v = token_j] - G p_v.
template <typename T>
FRL_HD T entries_grad_sum(const T* gl, int64_t k) {
  T sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += gl[j];
  return sum;
}

// The final gradient of raw logit x in the column of a chosen token: logit_grad with the row's
// summed G (entries_grad_sum), plus the upstream gradients of every entry choosing this column
// (several entries may name one token), through the logit map.
template <typename T, class Logit>
FRL_HD T chosen_column_grad(T x, const int64_t* targets, const T* gl, int64_t k, int64_t target, T m, T tau,
                            T log_sum, T log_sum_minus_entropy, T G, T ge, const Logit& logit) {
  T own = 0;
  for (int64_t j = 0; j < k; ++j) own += targets[j] == target ? gl[j] : T(0);
  return (logit_grad(logit(x), m, tau, log_sum, log_sum_minus_entropy, G, ge) + own) * logit.slope(x);
}

// Before a row's logits are overwritten by their gradients: for each entry j whose token falls
// inside the chunk (global ids targets [k], column 0 the global id col0), the final gradient of its
// column into values[j] (chosen_column_grad); returns G. scatter_chosen_grads then writes them over
// what the row's probability term wrote there (entries naming one token write one value).
template <typename T, class Logit>
FRL_HD T gather_chosen_grads(const T* x, const int64_t* targets, const T* gl, int64_t k, int64_t col0, int64_t C,
                             T m, T tau, T log_sum, T log_sum_minus_entropy, T ge, const Logit& logit, T* values) {
  const T G = entries_grad_sum(gl, k);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t target = targets[j] - col0;
    if (target >= 0 && target < C) {
      values[j] = chosen_column_grad(x[target], targets, gl, k, targets[j], m, tau, log_sum, log_sum_minus_entropy, G,
                                     ge, logit);
    }
  }
  return G;
}

template <typename T, typename G, class Round>
FRL_HD void scatter_chosen_grads(G* d, const int64_t* targets, const T* values, int64_t k, int64_t col0, int64_t C,
                                 const Round& round) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t target = targets[j] - col0;
    if (target >= 0 && target < C) d[target] = round(values[j]);
  }
}

}  // namespace fused_rl_ops::chosen_logprob
