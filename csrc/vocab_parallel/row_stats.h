// A row's softmax partial over the vocabulary seen so far, as chosen_logprob and top_logprobs keep it
// (per-row math shared by the CPU and CUDA kernels). For logits z = map(x) (vocab_parallel/logit_map.h):
//   m = max z,  s = sum exp(z - m),  t = sum exp(z - m) (z - m)
// which merge exactly across vocab chunks and TP ranks; then lse = m + log s and entropy =
// log s - t / s. t is kept relative to m (every term <= 0), so the entropy needs no cancellation of
// large logits.
// Non-finite logits give what float64 log_softmax gives: a NaN or +inf makes the row NaN; a -inf adds
// nothing (0 log 0 = 0). A partial with no mass is marked by max = -inf (sums 0), never by its sums,
// since a NaN sum must propagate. A softcap maps a raw +-inf to the finite +-c / T.
#pragma once

#include <cstdint>

#include "common/math.h"
#include "vocab_parallel/softmax_partial.h"

namespace fused_rl_ops {

// The columns of a position's row of stats, [N, stats_column::chosen + k] for k chosen tokens per
// position: m, s, t, then the tokens' logits z[token] (0 where another shard holds the token).
namespace stats_column {
enum : int { max, sum, ent, chosen, count };
}

// A softmax partial (vocab_parallel/softmax_partial.h: partial_empty, partial_merge via stats_merge).
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

}  // namespace fused_rl_ops
