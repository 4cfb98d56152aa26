// The merge of a softmax partial (softmax_partial.h: RowStats, vocab_divergence's Side) over the lanes
// of a warp, for the warp-per-row kernels of every op (device code only).
#pragma once

#include "common/cuda_utils.cuh"

namespace fused_rl_ops {

// Every lane's partial p merged with merge(a, b), which must be symmetric (merging b into a gives
// the bits merging a into b gives), in the same butterfly order on every call (deterministic);
// every lane gets the total.
template <class Partial, class Merge>
__device__ __forceinline__ Partial warp_partial(Partial p, const Merge& merge) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    Partial other = p;
    auto& [max, sum, second_sum] = other;
    max = __shfl_xor_sync(0xffffffffu, max, o);
    sum = __shfl_xor_sync(0xffffffffu, sum, o);
    second_sum = __shfl_xor_sync(0xffffffffu, second_sum, o);
    merge(p, other);
  }
  return p;
}

}  // namespace fused_rl_ops
