// A softmax partial, what RowStats (row_stats.h) and vocab_divergence's Side each are: the max m
// of some logits (-inf while empty: no probability mass) and two sums taken against it, which merge
// exactly across vocab chunks and TP ranks as m moves. Shared by the CPU and CUDA kernels.
#pragma once

#include "common/math.h"

namespace fused_rl_ops {

// The partial of no logits (Partial: an aggregate {max, sum, other sum} of one scalar type).
template <class Partial>
FRL_HD Partial partial_empty() {
  using T = decltype(Partial::max);
  return {T(-INFINITY), T(0), T(0)};
}

// Merges partial b into a: an empty b changes nothing and an empty a takes b, told by the max's mark,
// never by the sums (a NaN sum must propagate); otherwise merge_at(m) moves both partials' sums to
// the larger max m (NaN if either is) and adds them into a.
template <class Partial, class MergeAt>
FRL_HD void partial_merge(Partial& a, const Partial& b, const MergeAt& merge_at) {
  using T = decltype(Partial::max);
  if (b.max == T(-INFINITY)) return;
  if (a.max == T(-INFINITY)) {
    a = b;
    return;
  }
  merge_at(Math<T>::max(a.max, b.max));
}

}  // namespace fused_rl_ops
