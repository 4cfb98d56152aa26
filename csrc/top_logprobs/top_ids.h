// A row's k largest logits with their ids, shared by the CPU and CUDA kernels. Strictly ordered (a
// larger logit first, between equal ones the lower id), unlike the sampler filter's top, so that the
// k kept are the first k of that order whatever the chunks and ranks, whose tops merge by it. It
// starts full of placeholders (-inf, kNoId) that every real logit precedes, so it needs no count; a
// NaN is never taken (its row's logprobs are NaN anyway).
#pragma once

#include <cstdint>

#include "common/math.h"

namespace fused_rl_ops::top_logprobs {

// The id of a placeholder: after every real id.
constexpr int64_t kNoId = INT64_MAX;

// Whether (v, id) comes before (w, other) in the order of a top.
template <typename T>
FRL_HD bool top_before(T v, int64_t id, T w, int64_t other) {
  return v > w || (v == w && id < other);
}

// Gives (v, id) to a top of k entries, values [k] and ids [k] a heap whose root is its last entry
// in the order (the one a new entry replaces).
template <typename T>
FRL_HD void top_ids_push(T* values, int64_t* ids, int64_t k, T v, int64_t id) {
  if (!top_before(v, id, values[0], ids[0])) return;
  int64_t i = 0;  // (v, id) replaces the root: sift down
  for (int64_t child = 1; child < k; child = 2 * i + 1) {
    if (child + 1 < k && top_before(values[child], ids[child], values[child + 1], ids[child + 1])) ++child;
    if (!top_before(v, id, values[child], ids[child])) break;
    values[i] = values[child];
    ids[i] = ids[child];
    i = child;
  }
  values[i] = v;
  ids[i] = id;
}

}  // namespace fused_rl_ops::top_logprobs
