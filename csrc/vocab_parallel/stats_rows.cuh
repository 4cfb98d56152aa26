// The CUDA kernel that merges a chunk's logits into each row's softmax partial (row_stats.h), shared
// by chosen_logprob and top_logprobs, with its launcher, which their launchers call (device code and
// a torch-free launcher: included by their kernel.cu). Params: as stats_rows.h says.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "common/cuda_utils.cuh"
#include "common/launch.h"
#include "vocab_parallel/logit_map.h"
#include "vocab_parallel/row_stats.h"
#include "vocab_parallel/warp_partial.cuh"

namespace fused_rl_ops {

constexpr int kStatsRowsPerBlock = 8;  // one warp per row
constexpr int kStatsWidth = 4;         // columns per lane and access where aligned (16 bytes)

// A warp per row reads it once: each lane keeps online stats (stats_add_online) of kWidth columns
// at a time (kWidth where the launcher finds the rows aligned for it, else 1), lane l taking columns
// [kWidth l, kWidth (l + 1)), then those kWarp kWidth further on; the lanes merge in a fixed
// butterfly. The lanes take the chosen logits of tokens [N, entries] (entries may be 0) lane, lane +
// 32, ...
template <class Logit, int kWidth>
__global__ void vocab_parallel_stats_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, int64_t col0,
                                                 const int64_t* __restrict__ tokens, int64_t entries, Logit logit,
                                                 const float* __restrict__ threshold, float* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kStatsRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kStatsRowsPerBlock) {
    const float* x = logits + r * C;
    const float tau = threshold ? threshold[r] : -INFINITY;
    RowStats<float> lane_stats = partial_empty<RowStats<float>>();
    for (int64_t k = int64_t(lane) * kWidth; k < C; k += kWarp * kWidth) {
      const Pack<float, kWidth> in = *reinterpret_cast<const Pack<float, kWidth>*>(x + k);
      float z[kWidth];
#pragma unroll
      for (int i = 0; i < kWidth; ++i) z[i] = logit(in.v[i]);
      stats_add_online(lane_stats, z, tau);
    }
    float* row = stats + (stats_column::chosen + entries) * r;
    const RowStats<float> chunk =
        warp_partial(lane_stats, [](RowStats<float>& a, const RowStats<float>& b) { stats_merge(a, b); });
    if (lane == 0) stats_update_row(row, chunk);
    if (entries > 0) {
      stats_pick_chosen(row + stats_column::chosen, tokens + entries * r, entries, lane, kWarp, x, col0, C, logit);
    }
  }
}

// Reads p's logits, tokens and threshold; merges the chunk into p's stats.
template <class Params>
cudaError_t launch_stats_rows(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0 || p.cols == 0) return cudaSuccess;
  const bool vectorised = p.cols % kStatsWidth == 0 && is_aligned(p.logits, sizeof(Pack<float, kStatsWidth>));
  cudaError_t err = cudaSuccess;
  with_logit_map<float>(p.logit_map, [&](auto logit) {
    const auto launch = [&](auto width) {
      err = launch_grid_stride(vocab_parallel_stats_rows_kernel<decltype(logit), decltype(width)::value>,
                               (N + kStatsRowsPerBlock - 1) / kStatsRowsPerBlock, kStatsRowsPerBlock * kWarp, 0,
                               stream, static_cast<const float*>(p.logits), N, p.cols, p.col0, p.tokens,
                               p.tokens_per_row, logit, static_cast<const float*>(p.threshold),
                               static_cast<float*>(p.stats));
    };
    if (vectorised) launch(std::integral_constant<int, kStatsWidth>{});
    else launch(std::integral_constant<int, 1>{});
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace fused_rl_ops
