// chosen_logprob CUDA row kernels (device code only: no torch headers, no launches). Included by
// chosen_logprob/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "chosen_logprob/math.h"

namespace fused_rl_ops::chosen_logprob {

constexpr int kStatsRowsPerBlock = 8;  // stats: one warp per row
constexpr int kGradThreads = 256;     // grad: threads per block, laid out by row_launch
constexpr int kCombineThreads = 256;  // combine: one thread per row

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = Math<float>::max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A warp reads its row twice (max, then sums); the second pass mostly hits L1/L2. Lanes take
// columns lane, lane + 32, ... and the butterfly reductions fix the order: deterministic.
// Logit: PlainLogit<float> or SoftcappedLogit<float> (chosen_logprob/math.h), raw logits -> z.
template <class Logit>
__global__ void chosen_logprob_stats_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, int64_t col0,
                                                 const int64_t* __restrict__ tokens, Logit logit,
                                                 float* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kStatsRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kStatsRowsPerBlock) {
    const float* x = logits + r * C;
    float m = -INFINITY;
    for (int64_t k = lane; k < C; k += kWarp) m = Math<float>::max(m, x[k]);
    m = logit(warp_max(m));  // the map is nondecreasing: the largest z is the map of the largest x
    float s = 0.f, t = 0.f;
    for (int64_t k = lane; k < C; k += kWarp) stats_add(logit(x[k]), m, s, t);
    s = warp_sum(s);
    t = warp_sum(t);
    if (lane == 0) {
      stats_update_row(stats + stats_column::count * r, RowStats<float>{m, s, t}, x, tokens[r] - col0, C, logit);
    }
  }
}

template <class Logit>
__global__ void chosen_logprob_grad_rows_kernel(float* __restrict__ logits, int64_t N, int64_t C, int64_t col0,
                                                const int64_t* __restrict__ tokens, const float* __restrict__ row_max,
                                                const float* __restrict__ log_sum,
                                                const float* __restrict__ log_sum_minus_entropy,
                                                const float* __restrict__ gl, const float* __restrict__ ge,
                                                Logit logit) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < N; r += int64_t(gridDim.x) * blockDim.y) {
    float* x = logits + r * C;
    const float m = row_max[r], l = log_sum[r], l_minus_ent = log_sum_minus_entropy[r], g = gl[r], e = ge[r];
    const int64_t target = tokens[r] - col0;
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
      const float xk = x[k];
      float d = logit_grad(logit(xk) - m, l, l_minus_ent, g, e);
      if (k == target) d += g;
      x[k] = d * logit.slope(xk);
    }
  }
}

__global__ void chosen_logprob_combine_kernel(const float* __restrict__ partials, int64_t ranks, int64_t N,
                                              float* __restrict__ out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    combine_row(partials, ranks, N, r, out);
  }
}

}  // namespace fused_rl_ops::chosen_logprob
