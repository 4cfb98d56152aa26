// chosen_logprob CUDA row kernels (device code only: no torch headers, no launches). Included by
// chosen_logprob/kernel.cu, whose launchers pick the grids, and by the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "chosen_logprob/math.h"
#include "chosen_logprob/sampler_filter.h"

namespace fused_rl_ops::chosen_logprob {

constexpr int kGradThreads = 256;     // grad: threads per block, laid out by row_launch
constexpr int kGradWidth = 4;         // grad: columns per thread and access where aligned (16 bytes of fp32)
constexpr int kCombineThreads = 256;  // combine: one thread per row
constexpr int kTopRowsPerBlock = 8;   // top: one warp per row
constexpr int kHistThreads = 256;     // hist: one block per row, of whole warps
constexpr int kEntryThreads = 128;    // grad with several tokens per position: one thread per row

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
// At most 32 registers a thread, so that 2048 / kGradThreads blocks fill an SM of sm_80 / sm_90
// (the vector paths would take 37-38 and fit fewer; grid_for sizes the grid by what fits).
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
    const int64_t chosen = tokens ? tokens[r] - col0 : -1;
    const int target = chosen >= 0 && chosen < C ? int(chosen) : -1;
    for (int k = int(threadIdx.x) * kWidth; k < int(C); k += int(blockDim.x) * kWidth) {
      const Pack<float, kWidth> in = *reinterpret_cast<const Pack<float, kWidth>*>(x + k);
      Pack<G, kWidth> out;
#pragma unroll
      for (int i = 0; i < kWidth; ++i) {
        out.v[i] = from_float<G>(raw_logit_grad(in.v[i], k + i == target, m, tau, l, l_minus_ent, g, e, logit));
      }
      store_pack(d + k, out);
    }
  }
}

// Several tokens per position, k > 1 (math.h's gather_chosen_grads), around the grad kernel run
// without tokens: first, one thread per row takes, from the logits, its chosen columns' gradients
// and the row's summed logprob gradient G into entry_grads ([N] G, then [N, k]); the grad kernel
// then writes every column with G alone, and the scatter writes the chosen columns over it, rounded
// once to G's dtype.
template <class Logit>
__global__ void chosen_logprob_gather_entry_grads_kernel(const float* __restrict__ logits, int64_t N, int64_t C,
                                                         int64_t col0, const int64_t* __restrict__ tokens, int64_t k,
                                                         const float* __restrict__ row_max,
                                                         const float* __restrict__ log_sum,
                                                         const float* __restrict__ log_sum_minus_entropy,
                                                         const float* __restrict__ gl, const float* __restrict__ ge,
                                                         const float* __restrict__ threshold, Logit logit,
                                                         float* __restrict__ entry_grads) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    const float tau = threshold ? threshold[r] : -INFINITY;
    entry_grads[r] = gather_chosen_grads(logits + r * C, tokens + k * r, gl + k * r, k, col0, C, row_max[r], tau,
                                         log_sum[r], log_sum_minus_entropy[r], ge[r], logit, entry_grads + N + k * r);
  }
}

template <typename G>
__global__ void chosen_logprob_scatter_entry_grads_kernel(int64_t N, int64_t C, int64_t col0,
                                                          const int64_t* __restrict__ tokens, int64_t k,
                                                          const float* __restrict__ entry_grads, G* __restrict__ grads,
                                                          int64_t grads_stride) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    scatter_chosen_grads(grads + r * grads_stride, tokens + k * r, entry_grads + N + k * r, k, col0, C,
                         [](float v) { return from_float<G>(v); });
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

// Adds each lane's value to bins[bin] (shared memory; bin < 0: nothing) with one atomic addition per
// bin the warp holds: a 64-bit shared atomicAdd is a compare-and-swap loop, which stalls when many
// lanes hit one bin. The lanes of a bin (__match_any_sync) sum their values in a tree over their
// ranks, the lowest lane adding the total: each round a lane of even rank takes the value of the
// next lane of its bin still in the tree (of odd rank), which leaves it, and the ranks halve. Sums of
// integers: the order changes no bit. Called by every lane of a full warp.
__device__ __forceinline__ void warp_add_to_bins(unsigned long long* bins, int bin, unsigned long long value) {
  const unsigned lane = threadIdx.x % kWarp;
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  unsigned rank = __popc(peers & ((1u << lane) - 1));  // the lanes of the bin below this one
  const bool lowest = rank == 0;
  unsigned above = peers & ~((2u << lane) - 1);  // the lanes of the bin above it still in the tree
  while (__any_sync(0xffffffffu, above != 0)) {
    const unsigned long long next = __shfl_sync(0xffffffffu, value, above != 0 ? __ffs(above) - 1 : int(lane));
    if (rank % 2 == 0 && above != 0) value += next;
    above &= __ballot_sync(0xffffffffu, rank % 2 == 0);  // lanes of odd rank leave the tree
    rank /= 2;
  }
  if (lowest && bin >= 0) atomicAdd(&bins[bin], value);
}

// Adds the mass (relative to row_max) of each logit of a row's search window to the row's
// histogram (sampler_filter.h): a block per row sums the chunk's masses per bin in shared memory, in
// integers, so that the order of the atomic additions changes no bit, then adds them to the row's.
// The warps take 32 columns at a time, every lane the same iterations (warp_add_to_bins).
template <class Logit>
__global__ void chosen_logprob_hist_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, Logit logit,
                                                const float* __restrict__ row_max, const double* __restrict__ window,
                                                int64_t* __restrict__ hist) {
  __shared__ unsigned long long bins[kSearchBins];
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const SearchWindow w{window[2 * r], window[2 * r + 1]};
    if (!w.active()) continue;
    for (int j = threadIdx.x; j < kSearchBins; j += blockDim.x) bins[j] = 0;
    __syncthreads();
    const float m = row_max[r];
    const float* x = logits + r * C;
    for (int64_t k0 = int64_t(threadIdx.x) - lane; k0 < C; k0 += blockDim.x) {
      const int64_t k = k0 + lane;
      int bin = -1;
      unsigned long long mass = 0;
      if (k < C) {
        const float z = logit(x[k]);
        const double cell = w.cell(z);
        if (SearchWindow::in_range(cell)) {
          bin = int(cell);
          mass = static_cast<unsigned long long>(mass_units(Math<float>::exp(z - m)));
        }
      }
      warp_add_to_bins(bins, bin, mass);
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
                                              int64_t columns, float* __restrict__ out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    combine_row(partials, ranks, N, r, columns, out);
  }
}

}  // namespace fused_rl_ops::chosen_logprob
