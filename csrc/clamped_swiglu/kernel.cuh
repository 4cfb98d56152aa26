// Clamped SwiGLU CUDA kernels (device code only: no torch headers, no launches): one pass over
// memory each way. A thread owns N consecutive outputs and moves them with vector loads (16 bytes of
// x per load where alignment allows). Included by clamped_swiglu/kernel.cu and the kernels-on-CPU tests.
#pragma once

#include "common/cuda_utils.cuh"
#include "clamped_swiglu/math.h"

namespace fused_rl_ops::clamped_swiglu {

constexpr int kBlockThreads = 256;

// Threads are laid out [rows, columns] within a block (blockDim.x threads along a row, each
// owning N outputs; blockDim.y rows), blocks stride over rows: no integer division per element.
// x's (gate, linear) pairs of outputs [c, c + N) in the interleaved layout, moved as one pack. The
// scalar path (N = 1) only has T's alignment, so its pair is two elements, not an aligned pack.
template <typename T, int N>
struct InterleavedPack {
  using type = Pack<T, 2 * N>;
};
template <typename T>
struct InterleavedPack<T, 1> {
  struct type {
    T v[2];
  };
};

// Loads gate and linear values for outputs [c, c + N) of one row.
template <typename T, int N, bool kInterleaved>
__device__ __forceinline__ void load_gate_linear(const T* row, int64_t F, int64_t c, float* g, float* u) {
  if (kInterleaved) {
    const auto pack = *reinterpret_cast<const typename InterleavedPack<T, N>::type*>(row + 2 * c);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      g[k] = to_float(pack.v[2 * k]);
      u[k] = to_float(pack.v[2 * k + 1]);
    }
  } else {
    const auto pg = *reinterpret_cast<const Pack<T, N>*>(row + c);
    const auto pu = *reinterpret_cast<const Pack<T, N>*>(row + F + c);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      g[k] = to_float(pg.v[k]);
      u[k] = to_float(pu.v[k]);
    }
  }
}

// scale: the weighted form's [rows] fp32 scales (y = scale * swiglu, rounded once), or null.
template <typename T, int N, bool kInterleaved>
__global__ void clamped_swiglu_forward_kernel(const T* __restrict__ x, const float* __restrict__ scale,
                                              T* __restrict__ y, int64_t rows, int64_t F, Activation p) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    const float s = scale == nullptr ? 1.0f : scale[r];
    for (int64_t c = threadIdx.x * int64_t(N); c < F; c += int64_t(blockDim.x) * N) {
    float g[N], u[N];
    load_gate_linear<T, N, kInterleaved>(x + r * 2 * F, F, c, g, u);
    Pack<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      out.v[k] = from_float<T>(clamped_swiglu_forward(g[k], u[k], p) * s);
    }
    *reinterpret_cast<Pack<T, N>*>(y + r * F + c) = out;
    }
  }
}

// Stores gradients of gate and linear values for outputs [c, c + N) of one row.
template <typename T, int N, bool kInterleaved>
__device__ __forceinline__ void store_gate_linear(T* row, int64_t F, int64_t c, const float* dg, const float* du) {
  if (kInterleaved) {
    typename InterleavedPack<T, N>::type out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      out.v[2 * k] = from_float<T>(dg[k]);
      out.v[2 * k + 1] = from_float<T>(du[k]);
    }
    *reinterpret_cast<typename InterleavedPack<T, N>::type*>(row + 2 * c) = out;
  } else {
    Pack<T, N> og, ou;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      og.v[k] = from_float<T>(dg[k]);
      ou.v[k] = from_float<T>(du[k]);
    }
    *reinterpret_cast<Pack<T, N>*>(row + c) = og;
    *reinterpret_cast<Pack<T, N>*>(row + F + c) = ou;
  }
}

// Gradients for outputs [c, c + N) of row r: grad(g, u, dy, dg, du) per element; returns sum plus
// what grad returns, added in element order (the weighted backward's running partial of dscale).
template <typename T, int N, bool kInterleaved, class Grad>
__device__ __forceinline__ float backward_tile(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                                               int64_t r, int64_t F, int64_t c, float sum, Grad grad) {
  float g[N], u[N], dg[N], du[N];
  load_gate_linear<T, N, kInterleaved>(x + r * 2 * F, F, c, g, u);
  const auto pdy = *reinterpret_cast<const Pack<T, N>*>(dy + r * F + c);
#pragma unroll
  for (int k = 0; k < N; ++k) sum += grad(g[k], u[k], to_float(pdy.v[k]), dg[k], du[k]);
  store_gate_linear<T, N, kInterleaved>(dx + r * 2 * F, F, c, dg, du);
  return sum;
}

template <typename T, int N, bool kInterleaved>
__global__ void
    clamped_swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, int64_t rows,
                                   int64_t F, Activation p) {
  const auto grad = [&](float g, float u, float d, float& dg, float& du) {
    clamped_swiglu_backward(g, u, d, p, dg, du);
    return 0.0f;
  };
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    for (int64_t c = threadIdx.x * int64_t(N); c < F; c += int64_t(blockDim.x) * N) {
      backward_tile<T, N, kInterleaved>(dy, x, dx, r, F, c, 0.0f, grad);
    }
  }
}

// Sum of v over the blockDim.x threads of this thread's row (blockDim.x a power of two, at most
// kBlockThreads), in the same order on every call; thread x = 0 of the row gets the total. Every thread
// of the block must call it (it synchronises the block).
__device__ __forceinline__ float row_sum(float v) {
  __shared__ float warp_totals[kBlockThreads / kWarp];
  const int width = blockDim.x < kWarp ? blockDim.x : kWarp;
  v = warp_sum<true>(v, width);  // within the row: rows of fewer than kWarp threads share a warp
  if (blockDim.x <= kWarp) return v;
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  __syncthreads();  // the previous call's totals are read
  if (thread % kWarp == 0) warp_totals[thread / kWarp] = v;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0) {
    const int first = threadIdx.y * blockDim.x / kWarp;
    for (int w = 0; w < int(blockDim.x) / kWarp; ++w) total += warp_totals[first + w];
  }
  return total;
}

// The weighted backward (y = scale * swiglu): dx as clamped_swiglu_backward_kernel with dy * scale, and
// dscale[r] = sum over the row of dy * swiglu, each thread summing its outputs in order and
// row_sum combining the threads in a fixed order (deterministic). The row loop runs the same
// number of times in every thread of a block, as row_sum's barriers require.
template <typename T, int N, bool kInterleaved>
__global__ void clamped_swiglu_scaled_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                      const float* __restrict__ scale, T* __restrict__ dx,
                                                      float* __restrict__ dscale, int64_t rows, int64_t F, Activation p) {
  for (int64_t first = blockIdx.x * int64_t(blockDim.y); first < rows; first += int64_t(gridDim.x) * blockDim.y) {
    const int64_t r = first + threadIdx.y;
    float partial = 0.0f;
    if (r < rows) {
      const float s = scale[r];
      const auto grad = [&](float g, float u, float d, float& dg, float& du) {
        return clamped_swiglu_scaled_backward(g, u, d, s, p, dg, du);
      };
      for (int64_t c = threadIdx.x * int64_t(N); c < F; c += int64_t(blockDim.x) * N) {
        partial = backward_tile<T, N, kInterleaved>(dy, x, dx, r, F, c, partial, grad);
      }
    }
    const float total = row_sum(partial);
    if (r < rows && threadIdx.x == 0) dscale[r] = total;
  }
}

}  // namespace fused_rl_ops::clamped_swiglu
