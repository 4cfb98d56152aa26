// chosen_logprob CUDA row kernels (device code only: no torch headers, no launches). Included by
// chosen_logprob/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "chosen_logprob/math.h"

namespace fused_rl_ops::chosen_logprob {

constexpr int kStatsRowsPerBlock = 8;  // stats: one warp per row
constexpr int kGradThreads = 256;     // grad: threads per block, laid out by row_launch
constexpr int kGradWidth = 4;         // grad: columns per thread and access where aligned (16 bytes of fp32)
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

// d(grad_logprob * logprob + grad_entropy * entropy) / dx of one raw logit x of a row (logit_grad
// of chosen_logprob/math.h through the logit map); the chosen column adds g.
template <class Logit>
__device__ __forceinline__ float raw_logit_grad(float x, bool chosen, float m, float l, float l_minus_ent, float g,
                                                float e, const Logit& logit) {
  float d = logit_grad(logit(x) - m, l, l_minus_ent, g, e);
  if (chosen) d += g;
  return d * logit.slope(x);
}

// Logits [N, C] -> their gradients, rounded once to the gradient GEMMs' dtype G, into grads (rows
// grads_stride apart), which may be logits itself (G = float): every element is read and then
// written by one thread, so neither pointer is __restrict__. kWidth columns per thread and access
// (1: the scalar path), as the launcher picks by alignment. Blocks [columns, rows] (row_launch).
// At most 32 registers a thread, so that the 2048 / kGradThreads blocks per SM that grid_for
// counts on sm_80 / sm_90 are resident at once (the vector paths would take 37-38).
template <class Logit, typename G, int kWidth>
__global__ void __launch_bounds__(kGradThreads, 2048 / kGradThreads)
    chosen_logprob_grad_rows_kernel(const float* logits, int64_t N, int64_t C, int64_t col0,
                                    const int64_t* __restrict__ tokens, const float* __restrict__ row_max,
                                    const float* __restrict__ log_sum, const float* __restrict__ log_sum_minus_entropy,
                                    const float* __restrict__ gl, const float* __restrict__ ge, Logit logit, G* grads,
                                    int64_t grads_stride) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < N; r += int64_t(gridDim.x) * blockDim.y) {
    const float* x = logits + r * C;
    G* d = grads + r * grads_stride;
    const float m = row_max[r], l = log_sum[r], l_minus_ent = log_sum_minus_entropy[r], g = gl[r], e = ge[r];
    const int64_t target = tokens[r] - col0;
    for (int64_t k = int64_t(threadIdx.x) * kWidth; k < C; k += int64_t(blockDim.x) * kWidth) {
      const Pack<float, kWidth> in = *reinterpret_cast<const Pack<float, kWidth>*>(x + k);
      Pack<G, kWidth> out;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        out.v[i] = from_float<G>(raw_logit_grad(in.v[i], k + i == target, m, l, l_minus_ent, g, e, logit));
      }
      *reinterpret_cast<Pack<G, kWidth>*>(d + k) = out;
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
