// The sampler's filter (top_k, top_p) per row, shared by the CPU and CUDA kernels. A token's kept
// set is {z >= tau}, tau its threshold, which the Python side finds over the whole vocabulary from two
// per-row partials summed over chunks and shards: the row's top (its K largest logits and how many
// more equal the smallest: top-k's threshold, top-p's candidates), and a search histogram (the mass
// of a window's logits per bin, in integers, so the sums are the same in any order: top-p's threshold,
// window by window). Every comparison is on the fp32 z the row kernels compute, so that all passes
// agree on every token.
#pragma once

#include "common/math.h"

namespace fused_rl_ops::chosen_logprob {

// The bins of a search histogram: the cells of a search window.
constexpr int kSearchBins = 512;

// A row's top, top_column::values + K columns in the accumulation type: how many logits it was
// given (seen), how many it holds (min(seen, K)), how many more of those seen equal the smallest it
// holds (ties), then the values held: a min-heap, values[0] the smallest. Counts are exact below
// 2^24 logits per row. The multiset held and the counts depend only on the multiset of logits
// given; the heap's order on their order too.
namespace top_column {
enum : int { seen, held, ties, values };
}

// The smallest logit that can change a row's top (-inf while it holds fewer than K).
template <typename T>
FRL_HD T top_floor(const T* top, int64_t K) {
  return top[top_column::held] < T(K) ? T(-INFINITY) : top[top_column::values];
}

// Gives v to a row's top (seen is the caller's to count). A NaN breaks the heap's order but no
// bound: a row with a NaN is NaN whatever its filter (chosen_logprob keeps it whole).
template <typename T>
FRL_HD void top_push(T* top, int64_t K, T v) {
  T* heap = top + top_column::values;
  const int64_t held = int64_t(top[top_column::held]);
  if (held < K) {  // sift up from the end
    int64_t i = held;
    while (i > 0 && heap[(i - 1) / 2] > v) {
      heap[i] = heap[(i - 1) / 2];
      i = (i - 1) / 2;
    }
    heap[i] = v;
    top[top_column::held] = T(held + 1);
    return;
  }
  const T smallest = heap[0];
  if (v < smallest) return;
  if (v == smallest) {
    top[top_column::ties] = top[top_column::ties] + T(1);
    return;
  }
  int64_t i = 0;  // v replaces the smallest: sift down from the root
  for (int64_t child = 1; child < K; child = 2 * i + 1) {
    if (child + 1 < K && heap[child + 1] < heap[child]) ++child;
    if (!(heap[child] < v)) break;
    heap[i] = heap[child];
    i = child;
  }
  heap[i] = v;
  // The smallest left the heap: with another copy of it as the new smallest it is one more tie;
  // else every tie is now below the smallest held.
  top[top_column::ties] = heap[0] == smallest ? top[top_column::ties] + T(1) : T(0);
}

// A window of a search round, per row: the cells j = hi - floor(z sigma), 0 <= j < kSearchBins, of
// a grid of spacing 1 / sigma (a power of 2: z sigma and the cells' edges are exact), j = 0 the
// highest. The cells of a window's bin j at sigma * kSearchBins are the next round's window. sigma
// 0: the row is not searched. In double: exact while |z| sigma < 2^53. -inf, +inf and NaN logits
// lie in no window.
struct SearchWindow {
  double sigma, hi;

  FRL_HD bool active() const { return sigma != 0; }
  template <typename T>
  FRL_HD double cell(T z) const {
    return hi - ::floor(double(z) * sigma);
  }
  FRL_HD static bool in_range(double cell) { return cell >= 0 && cell < kSearchBins; }
  // Bounds of the window's logits, lowest <= z < highest (to skip the cells of values outside).
  FRL_HD double lowest() const { return (hi - (kSearchBins - 1)) / sigma; }
  FRL_HD double highest() const { return (hi + 1) / sigma; }
};

// The probability mass of a logit z relative to its row maximum m's, mass = exp(z - m) <= 1, in
// units of 2^-40, rounded (half up): a search histogram's sums of up to 2^23 logits fit an int64
// exactly.
FRL_HD int64_t mass_units(double mass) { return static_cast<int64_t>(mass * 0x1p40 + 0.5); }

}  // namespace fused_rl_ops::chosen_logprob
