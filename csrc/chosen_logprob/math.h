// Chosen-token log-softmax and entropy, per-row math shared by the CPU and CUDA kernels.
// The GEMMs give raw logits x = h . w; the softmax takes z = map(x), the logit map of
// common/logit_map.h (PlainLogit, SoftcappedLogit).
// For a row of logits z the kernels keep, per token,
//   m = max z,  s = sum exp(z - m),  t = sum exp(z - m) (z - m)
// over the vocabulary seen so far; partials from vocab chunks and TP ranks merge exactly. Then
//   lse = m + log s,  entropy = lse - sum p z = log s - t / s.
// t is kept relative to m (every term <= 0), so entropy needs no cancellation of large logits; for
// the same reason the merged row hands on m and log s apart, and the backward works with z - m:
// the logit gradients then need no difference of large numbers either (lse - entropy rounded at
// |lse| would cost the entropy gradient ulp(|lse|) of absolute accuracy).
//
// Non-finite logits give what float64 log_softmax gives: a NaN makes m NaN (max propagates it), so
// lse and entropy are NaN; a +inf makes z - m NaN, hence NaN too; a -inf has probability 0 and adds
// nothing (0 log 0 = 0), so the rest stays finite. A partial with no probability mass (no valid
// rows: a chunk or rank of padding, or only -inf logits) is marked by max = -inf with sum = ent = 0;
// merges skip it by that mark, never by its sum (a NaN sum must propagate). A row whose logits are
// all -inf ends with sum 0, so lse = -inf and entropy = NaN, as the reference gives. With a
// softcap, a raw +-inf becomes the finite z = +-c / T (tanh(+-inf) = +-1), so it has probability
// > 0 and passes no gradient through tanh (slope 0), as float64 autograd of c tanh(x / c) gives; a
// NaN stays NaN.
#pragma once

#include "common/logit_map.h"
#include "common/math.h"
#include "common/softmax_partial.h"

namespace fused_rl_ops::chosen_logprob {

// The columns of a position's row of stats, [N, stats_column::chosen + k] for k tokens per position
// (stats_column::count for one): a vocab shard's partials (m, s, t, then the k chosen logits
// z[token], 0 where another shard holds the token; stats_update_row, stats_pick_chosen), and what
// combine_row makes of the shards' partials (m, log s, entropy, the k chosen logits).
namespace stats_column {
enum : int { max, sum, ent, chosen, count };
}
namespace combined_column {
enum : int { row_max, log_sum, entropy, chosen };
}

// A softmax partial (common/softmax_partial.h: partial_empty, partial_merge via stats_merge).
template <typename T>
struct RowStats {
  T max;  // m; -inf while empty
  T sum;  // s
  T ent;  // t
};

// Adds one logit z to the sums taken against the row maximum m, unless the sampler's filter drops
// it: z < tau, the token's threshold (-inf keeps every logit; a NaN is never dropped;
// chosen_logprob/sampler_filter.h). A -inf logit adds nothing: computed, it would add 0 * -inf =
// NaN to t (and NaN to both when m is -inf as well).
template <typename T>
FRL_HD void stats_add(T z, T m, T& s, T& t, T tau) {
  const T d = z - m;
  const T e = Math<T>::exp(d);
  const auto dropped = (z == T(-INFINITY)) | (z < tau);
  s = s + Math<T>::select(dropped, T(0), e);
  t = t + Math<T>::select(dropped, T(0), e * d);
}

// The maximum m of a chunk's logits as the sums take it under the threshold tau: a chunk whose
// largest logit is dropped keeps none, so its partial is the empty one (max -inf).
template <typename T>
FRL_HD T kept_max(T m, T tau) {
  return m < tau ? T(-INFINITY) : m;
}

// Moves r's sums to the maximum m >= r.max (or NaN): they are taken relative to the maximum, so
// with d = r.max - m, t becomes exp(d) (t + s d) and s becomes exp(d) s. An empty r (max -inf, sums
// 0) just takes m.
template <typename T>
FRL_HD void stats_rescale(RowStats<T>& r, T m) {
  if (r.max != T(-INFINITY)) {
    const T d = r.max - m;
    const T a = Math<T>::exp(d);
    r.ent = a * (r.ent + r.sum * d);
    r.sum = a * r.sum;
  }
  r.max = m;
}

// Merges b into a (partial_merge): both sums are moved to the larger maximum. A partial marked empty
// (max = -inf) changes nothing; any NaN in either reaches the result. Symmetric (merging a into b gives the
// same bits), so the lanes of a butterfly agree.
template <typename T>
FRL_HD void stats_merge(RowStats<T>& a, const RowStats<T>& b) {
  partial_merge(a, b, [&](T m) {
    RowStats<T> moved = b;
    stats_rescale(a, m);
    stats_rescale(moved, m);
    a.ent = a.ent + moved.ent;
    a.sum = a.sum + moved.sum;
  });
}

// Adds n logits z to the running stats r in one pass over them (the online softmax), as the sums
// over the logits the threshold tau keeps: r's maximum is first raised to the largest of them
// (stats_rescale, when it rises), then each is added against it (stats_add).
template <typename T, int n>
FRL_HD void stats_add_online(RowStats<T>& r, const T (&z)[n], T tau) {
  T m = r.max;
  for (int i = 0; i < n; ++i) m = Math<T>::max(m, z[i] < tau ? T(-INFINITY) : z[i]);
  if (!(m == r.max)) stats_rescale(r, m);  // NaN: rescaled to NaN
  for (int i = 0; i < n; ++i) stats_add(z[i], r.max, r.sum, r.ent, tau);
}

template <typename T>
FRL_HD T stats_entropy(const RowStats<T>& r) {
  return Math<T>::log(r.sum) - r.ent / r.sum;
}

// Merges one vocab chunk's sums into a position's row of stats.
template <typename T>
FRL_HD void stats_update_row(T* row, const RowStats<T>& chunk) {
  RowStats<T> running{row[stats_column::max], row[stats_column::sum], row[stats_column::ent]};
  stats_merge(running, chunk);
  row[stats_column::max] = running.max;
  row[stats_column::sum] = running.sum;
  row[stats_column::ent] = running.ent;
}

// Takes the chosen logits logit(x[target]) of a position's entries j = first, first + step, ... < k
// (targets: their k global ids) whose token falls inside the chunk (x: its C raw logits, column 0
// the global id col0) into chosen[j]; the others keep theirs.
template <typename T, class Logit>
FRL_HD void stats_pick_chosen(T* chosen, const int64_t* targets, int64_t k, int64_t first, int64_t step, const T* x,
                              int64_t col0, int64_t C, const Logit& logit) {
  for (int64_t j = first; j < k; j += step) {
    const int64_t target = targets[j] - col0;
    if (target >= 0 && target < C) chosen[j] = logit(x[target]);
  }
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
