// Value head CUDA kernels (device code only: no torch headers, no launches), each one pass over
// hidden with 16-byte loads where alignment allows: the forward gives each row to a warp; the hidden
// gradient is a broadcast write; the weight and bias gradients are the two fixed-order stages of
// value_head/math.h (no atomics). Included by value_head/kernel.cu and the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "value_head/math.h"

namespace fused_rl_ops::value_head {

constexpr int kForwardWarps = 8;  // rows per forward block, one per warp
constexpr int kLoadsInFlight = 4;  // packs a lane (forward) or rows a thread (stage 1) loads before using them
constexpr int kBroadcastThreads = 256;
constexpr int kStage1Warps = 4;  // stage 1: warps per block, each summing a quarter of the row block
constexpr int kSumSlices = 16;  // stage 2: partial rows b = y, y + 16, ... go to thread row y

// N consecutive floats, as 16-byte loads when N is a multiple of 4 (p is then 16-byte aligned).
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      const auto v = *reinterpret_cast<const Pack<float, 4>*>(p + k);
#pragma unroll
      for (int i = 0; i < 4; ++i) out[k + i] = v.v[i];
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = p[k];
  }
}

template <int N>
__device__ __forceinline__ void store_floats(float* p, const float (&in)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N; k += 4) {
      Pack<float, 4> v;
#pragma unroll
      for (int i = 0; i < 4; ++i) v.v[i] = in[k + i];
      *reinterpret_cast<Pack<float, 4>*>(p + k) = v;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = in[k];
  }
}

template <typename T, int N>
__device__ __forceinline__ float dot_pack(const Pack<T, N>& h, const float* w, float acc) {
  float wv[N];
  load_floats<N>(w, wv);
#pragma unroll
  for (int k = 0; k < N; ++k) acc = fmaf(to_float(h.v[k]), wv[k], acc);
  return acc;
}

// Block (32, kForwardWarps): warp y takes rows y, y + kForwardWarps, ... of the block's share.
template <typename T, int N>
__global__ void value_head_forward_kernel(const T* __restrict__ hidden, const float* __restrict__ weight,
                                          const float* __restrict__ bias, float* __restrict__ out, int64_t rows,
                                          int64_t H) {
  const int lane = threadIdx.x;
  const int64_t packs = H / N;
  const float b = bias ? *bias : 0.f;
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    const auto* row = reinterpret_cast<const Pack<T, N>*>(hidden + r * H);
    float acc[kLoadsInFlight] = {};
    int64_t p = lane;
    for (; p + (kLoadsInFlight - 1) * kWarp < packs; p += kLoadsInFlight * kWarp) {
      Pack<T, N> h[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) h[u] = row[p + u * kWarp];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) acc[u] = dot_pack(h[u], weight + (p + u * kWarp) * N, acc[u]);
    }
    for (; p < packs; p += kWarp) acc[0] = dot_pack(row[p], weight + p * N, acc[0]);
    float sum = 0.f;
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) sum += acc[u];
    sum = warp_sum(sum);
    if (lane == 0) out[r] = sum + b;
  }
}

// grad_hidden[r, c] = grad_out[r] * weight[c]; block laid out as row_launch gives.
template <typename T, int N>
__global__ void value_head_backward_hidden_kernel(const float* __restrict__ grad_out, const float* __restrict__ weight,
                                                  T* __restrict__ grad_hidden, int64_t rows, int64_t H) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    const float g = grad_out[r];
    for (int64_t c = threadIdx.x * int64_t(N); c < H; c += int64_t(blockDim.x) * N) {
      float w[N];
      load_floats<N>(weight + c, w);
      Pack<T, N> dh;
#pragma unroll
      for (int k = 0; k < N; ++k) dh.v[k] = from_float<T>(g * w[k]);
      *reinterpret_cast<Pack<T, N>*>(grad_hidden + r * H + c) = dh;
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void accumulate_pack(float g, const Pack<T, N>& h, float (&acc)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = fmaf(g, to_float(h.v[k]), acc[k]);
}

// Stage 1: block (blockIdx.x, blockIdx.y) sums row block blockIdx.x over 32 * N columns. Block
// (32, kStage1Warps): thread (x, y) owns N columns and walks group y of the block's rows in order;
// thread row 0 then adds the groups in order. Splitting rows over warps, not only columns, gives
// enough warps in flight to saturate memory.
template <typename T, int N>
__global__ void value_head_partials_kernel(const float* __restrict__ grad_out, const T* __restrict__ hidden,
                                           float* __restrict__ weight_partials, float* __restrict__ bias_partials,
                                           int64_t rows, int64_t H) {
  __shared__ float group_sums[kStage1Warps][N][kWarp];
  __shared__ float group_g_sums[kStage1Warps];
  const int64_t block = blockIdx.x;
  const int64_t c = (int64_t(blockIdx.y) * kWarp + threadIdx.x) * N;
  const RowRange group = value_head_block_rows(block, rows, threadIdx.y, kStage1Warps);
  const T* column = hidden + c;
  float acc[N] = {};
  float g_sum = 0.f;
  int64_t r = group.begin;
  if (c < H) {  // c == 0 is always in range, so the bias sums below are complete
    for (; r + kLoadsInFlight <= group.end; r += kLoadsInFlight) {
      float g[kLoadsInFlight];
      Pack<T, N> h[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        g[u] = grad_out[r + u];
        h[u] = *reinterpret_cast<const Pack<T, N>*>(column + (r + u) * H);
      }
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        accumulate_pack(g[u], h[u], acc);
        g_sum += g[u];
      }
    }
    for (; r < group.end; ++r) {
      const float g = grad_out[r];
      accumulate_pack(g, *reinterpret_cast<const Pack<T, N>*>(column + r * H), acc);
      g_sum += g;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) group_sums[threadIdx.y][k][threadIdx.x] = acc[k];
  if (threadIdx.x == 0) group_g_sums[threadIdx.y] = g_sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= H) return;
#pragma unroll
  for (int y = 1; y < kStage1Warps; ++y) {
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] += group_sums[y][k][threadIdx.x];
    g_sum += group_g_sums[y];
  }
  store_floats<N>(weight_partials + block * H + c, acc);
  if (c == 0) bias_partials[block] = g_sum;
}

// Stage 2: out[c] = sum over b of partials[b, c]. Block (32, kSumSlices): thread row y sums the
// partial rows b = y mod kSumSlices in order, then thread row 0 adds the slices in order.
__global__ void value_head_sum_partials_kernel(const float* __restrict__ partials, float* __restrict__ out,
                                               int64_t blocks, int64_t cols) {
  __shared__ float slice_sums[kSumSlices][kWarp];
  const int64_t c = int64_t(blockIdx.x) * kWarp + threadIdx.x;
  float sum = 0.f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t b = threadIdx.y; b < blocks; b += kSumSlices) sum += partials[b * cols + c];
  }
  slice_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int y = 1; y < kSumSlices; ++y) sum += slice_sums[y][threadIdx.x];
    out[c] = sum;
  }
}

}  // namespace fused_rl_ops::value_head
