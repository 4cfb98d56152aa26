// top_logprobs' CUDA row kernel (device code only: no torch headers, no launches). Included by
// top_logprobs/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "top_logprobs/top_ids.h"

namespace fused_rl_ops::top_logprobs {

constexpr int kTopIdsRowsPerBlock = 8;  // one warp per row

// Gives each logit of a row with its global id to the row's top (top_ids.h), in column order as
// the CPU kernel does: the warp of a row takes 32 columns at a time, a ballot names those before
// the top's last entry, and lane 0 gives them one by one. Only lane 0 touches the row's top.
template <class Logit>
__global__ void top_logprobs_top_ids_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C,
                                                 int64_t col0, Logit logit, float* __restrict__ values,
                                                 int64_t* __restrict__ ids, int64_t K) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kTopIdsRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kTopIdsRowsPerBlock) {
    const float* x = logits + r * C;
    float* top = values + r * K;
    int64_t* top_id = ids + r * K;
    float last = __shfl_sync(0xffffffffu, lane == 0 ? top[0] : 0.f, 0);
    int64_t last_id = __shfl_sync(0xffffffffu, lane == 0 ? top_id[0] : 0, 0);
    for (int64_t c0 = 0; c0 < C; c0 += kWarp) {
      const int64_t c = c0 + lane;
      const bool column = c < C;
      const float z = column ? logit(x[c]) : -INFINITY;
      const unsigned given = __ballot_sync(0xffffffffu, column && top_before(z, col0 + c, last, last_id));
      for (unsigned rest = given; rest != 0; rest &= rest - 1) {
        const int from = __ffs(rest) - 1;
        const float v = __shfl_sync(0xffffffffu, z, from);
        if (lane == 0) top_ids_push(top, top_id, K, v, col0 + c0 + from);
      }
      if (given != 0) {
        last = __shfl_sync(0xffffffffu, lane == 0 ? top[0] : 0.f, 0);
        last_id = __shfl_sync(0xffffffffu, lane == 0 ? top_id[0] : 0, 0);
      }
    }
  }
}

}  // namespace fused_rl_ops::top_logprobs
