// chosen_logprob CUDA row kernels (device code only: no torch headers, no launches). Included by
// chosen_logprob/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "chosen_logprob/math.h"
#include "chosen_logprob/sampler_filter.h"

namespace fused_rl_ops::chosen_logprob {

constexpr int kStatsRowsPerBlock = 8;  // stats: one warp per row
constexpr int kGradThreads = 256;     // grad: threads per block, laid out by row_launch
constexpr int kGradWidth = 4;         // grad: columns per thread and access where aligned (16 bytes of fp32)
constexpr int kCombineThreads = 256;  // combine: one thread per row
constexpr int kTopRowsPerBlock = 8;   // top: one warp per row
constexpr int kHistThreads = 256;     // hist: one block per row

// A warp reads its row twice (max, then sums); the second pass mostly hits L1/L2. Lanes take
// columns lane, lane + 32, ... and the butterfly reductions fix the order: deterministic.
// Logit: PlainLogit<float> or SoftcappedLogit<float> (chosen_logprob/math.h), raw logits -> z.
template <class Logit>
__global__ void chosen_logprob_stats_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, int64_t col0,
                                                 const int64_t* __restrict__ tokens, Logit logit,
                                                 const float* __restrict__ threshold, float* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kStatsRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kStatsRowsPerBlock) {
    const float* x = logits + r * C;
    const float tau = threshold ? threshold[r] : -INFINITY;
    float m = -INFINITY;
    for (int64_t k = lane; k < C; k += kWarp) m = Math<float>::max(m, x[k]);
    m = kept_max(logit(warp_max(m)), tau);  // the map is nondecreasing: the largest z is the map of the largest x
    float s = 0.f, t = 0.f;
    for (int64_t k = lane; k < C; k += kWarp) stats_add(logit(x[k]), m, s, t, tau);
    s = warp_sum(s);
    t = warp_sum(t);
    if (lane == 0) {
      stats_update_row(stats + stats_column::count * r, RowStats<float>{m, s, t}, x, tokens[r] - col0, C, logit);
    }
  }
}

// d(grad_logprob * logprob + grad_entropy * entropy) / dx of one raw logit x of a row (logit_grad
// of chosen_logprob/math.h through the logit map, 0 below the threshold tau); the chosen column adds g.
template <class Logit>
__device__ __forceinline__ float raw_logit_grad(float x, bool chosen, float m, float tau, float l, float l_minus_ent,
                                                float g, float e, const Logit& logit) {
  float d = logit_grad(logit(x), m, tau, l, l_minus_ent, g, e);
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
                                    const float* __restrict__ gl, const float* __restrict__ ge,
                                    const float* __restrict__ threshold, Logit logit, G* grads, int64_t grads_stride) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < N; r += int64_t(gridDim.x) * blockDim.y) {
    const float* x = logits + r * C;
    G* d = grads + r * grads_stride;
    const float m = row_max[r], l = log_sum[r], l_minus_ent = log_sum_minus_entropy[r], g = gl[r], e = ge[r];
    const float tau = threshold ? threshold[r] : -INFINITY;
    // Columns in 32 bits (the launcher refuses chunks of 2^30 columns or more), which keeps the
    // filter's tau within the register budget; the chosen one, or -1 outside the chunk.
    const int64_t chosen = tokens[r] - col0;
    const int target = chosen >= 0 && chosen < C ? int(chosen) : -1;
    for (int k = int(threadIdx.x) * kWidth; k < int(C); k += int(blockDim.x) * kWidth) {
      const Pack<float, kWidth> in = *reinterpret_cast<const Pack<float, kWidth>*>(x + k);
      Pack<G, kWidth> out;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        out.v[i] = from_float<G>(raw_logit_grad(in.v[i], k + i == target, m, tau, l, l_minus_ent, g, e, logit));
      }
      *reinterpret_cast<Pack<G, kWidth>*>(d + k) = out;
    }
  }
}

// Gives each logit of a row that the filter keeps (threshold, null: all) and that lies in the row's
// search window (window, null: every logit) to the row's top (sampler_filter.h), in column order as
// the CPU kernel does: the warp of a row takes 32 columns at a time, a ballot names those that can
// change the top, and lane 0 gives them one by one. Only lane 0 touches the row's top.
template <class Logit>
__global__ void chosen_logprob_top_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, Logit logit,
                                               const float* __restrict__ threshold,
                                               const double* __restrict__ window, float* __restrict__ tops,
                                               int64_t K) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kTopRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kTopRowsPerBlock) {
    const SearchWindow w = window ? SearchWindow{window[2 * r], window[2 * r + 1]} : SearchWindow{1, 0};
    if (!w.active()) continue;
    const float tau = threshold ? threshold[r] : -INFINITY;
    const float* x = logits + r * C;
    float* top = tops + r * (top_column::values + K);
    float floor_value = __shfl_sync(0xffffffffu, lane == 0 ? top_floor(top, K) : 0.f, 0);
    int64_t seen = 0;
    for (int64_t k0 = 0; k0 < C; k0 += kWarp) {
      const int64_t k = k0 + lane;
      const float z = k < C ? logit(x[k]) : -INFINITY;
      const bool counted = k < C && !(z < tau) && (!window || SearchWindow::in_range(w.cell(z)));
      seen += __popc(__ballot_sync(0xffffffffu, counted));
      const unsigned given = __ballot_sync(0xffffffffu, counted && z >= floor_value);
      for (unsigned rest = given; rest != 0; rest &= rest - 1) {
        const float v = __shfl_sync(0xffffffffu, z, __ffs(rest) - 1);
        if (lane == 0) top_push(top, K, v);
      }
      if (given != 0) floor_value = __shfl_sync(0xffffffffu, lane == 0 ? top_floor(top, K) : 0.f, 0);
    }
    if (lane == 0) top[top_column::seen] += float(seen);
  }
}

// Adds the mass (relative to row_max) of each logit of a row's search window to the row's
// histogram (sampler_filter.h): a block per row sums the chunk's masses per bin in shared memory, in
// integers, so that the order of the atomic additions changes no bit, then adds them to the row's.
template <class Logit>
__global__ void chosen_logprob_hist_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, Logit logit,
                                                const float* __restrict__ row_max, const double* __restrict__ window,
                                                int64_t* __restrict__ hist) {
  __shared__ unsigned long long bins[kSearchBins];
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const SearchWindow w{window[2 * r], window[2 * r + 1]};
    if (!w.active()) continue;
    for (int j = threadIdx.x; j < kSearchBins; j += blockDim.x) bins[j] = 0;
    __syncthreads();
    const float m = row_max[r];
    const float* x = logits + r * C;
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
      const float z = logit(x[k]);
      const double cell = w.cell(z);
      if (SearchWindow::in_range(cell)) {
        atomicAdd(&bins[int(cell)], static_cast<unsigned long long>(mass_units(Math<float>::exp(z - m))));
      }
    }
    __syncthreads();
    int64_t* row = hist + r * kSearchBins;
    for (int j = threadIdx.x; j < kSearchBins; j += blockDim.x) {
      if (bins[j] != 0) row[j] += static_cast<int64_t>(bins[j]);
    }
    __syncthreads();  // the bins are read before the next row clears them
  }
}

__global__ void chosen_logprob_combine_kernel(const float* __restrict__ partials, int64_t ranks, int64_t N,
                                              float* __restrict__ out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    combine_row(partials, ranks, N, r, out);
  }
}

}  // namespace fused_rl_ops::chosen_logprob
