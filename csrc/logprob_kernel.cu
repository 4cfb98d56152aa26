// chosen_logprob CUDA row kernels; the GEMMs around them are cuBLAS calls made by the torch glue.
#include "cuda_utils.cuh"
#include "logprob_kernel.h"
#include "logprob_math.h"

namespace fused_rl_ops {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // one warp per row

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = Math<float>::max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A warp reads its row twice (max, then sums); the second pass mostly hits L1/L2. Lanes take
// columns lane, lane + 32, ... and the butterfly reductions fix the order: deterministic.
__global__ void stats_rows_kernel(const float* __restrict__ logits, int64_t N, int64_t C, int64_t col0,
                                  const int64_t* __restrict__ tokens, float inv_temp, float* __restrict__ stats) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / kWarp; r < N;
       r += int64_t(gridDim.x) * kRowsPerBlock) {
    const float* z = logits + r * C;
    float m = -INFINITY;
    for (int64_t k = lane; k < C; k += kWarp) m = Math<float>::max(m, z[k]);
    m = warp_max(m) * inv_temp;
    float s = 0.f, t = 0.f;
    for (int64_t k = lane; k < C; k += kWarp) stats_add(z[k] * inv_temp, m, s, t);
    s = warp_sum(s);
    t = warp_sum(t);
    if (lane == 0) stats_update_row(stats + 4 * r, RowStats<float>{m, s, t}, z, tokens[r] - col0, C, inv_temp);
  }
}

__global__ void grad_rows_kernel(float* __restrict__ logits, int64_t N, int64_t C, int64_t col0,
                                 const int64_t* __restrict__ tokens, const float* __restrict__ lse,
                                 const float* __restrict__ mean, const float* __restrict__ gl,
                                 const float* __restrict__ ge, float inv_temp) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < N; r += int64_t(gridDim.x) * blockDim.y) {
    float* z = logits + r * C;
    const float l = lse[r], mu = mean[r], g = gl[r], e = ge[r];
    const int64_t target = tokens[r] - col0;
    for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
      float d = logit_grad(z[k] * inv_temp, l, mu, g, e);
      if (k == target) d += g;
      z[k] = d * inv_temp;
    }
  }
}

__global__ void combine_kernel(const float* __restrict__ partials, int64_t ranks, int64_t N, float* __restrict__ out) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < N; r += int64_t(gridDim.x) * blockDim.x) {
    combine_row(partials, ranks, N, r, out);
  }
}

}  // namespace

cudaError_t launch_logprob_stats_rows(const float* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                                      float inv_temp, float* stats, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  const int threads = kRowsPerBlock * kWarp;
  stats_rows_kernel<<<grid_for((N + kRowsPerBlock - 1) / kRowsPerBlock, threads), threads, 0, stream>>>(
      logits, N, C, col0, tokens, inv_temp, stats);
  return cudaGetLastError();
}

cudaError_t launch_logprob_grad_rows(float* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                                     const float* lse, const float* mean, const float* gl, const float* ge,
                                     float inv_temp, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  const RowLaunch cfg = row_launch(N, C, 256);
  grad_rows_kernel<<<cfg.grid, cfg.block, 0, stream>>>(logits, N, C, col0, tokens, lse, mean, gl, ge, inv_temp);
  return cudaGetLastError();
}

cudaError_t launch_logprob_combine(const float* partials, int64_t ranks, int64_t N, float* out, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  combine_kernel<<<grid_for((N + 255) / 256, 256), 256, 0, stream>>>(partials, ranks, N, out);
  return cudaGetLastError();
}

}  // namespace fused_rl_ops
