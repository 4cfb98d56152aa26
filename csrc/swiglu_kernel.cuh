// Clamped SwiGLU CUDA kernels (device code only: no torch headers, no launches): one pass over
// memory each way. A thread owns N consecutive outputs and moves them with vector loads (16 bytes of
// x per load where alignment allows). Included by swiglu_kernel.cu and the kernels-on-CPU tests.
#pragma once

#include "cuda_utils.cuh"
#include "swiglu_math.h"

namespace fused_rl_ops {

constexpr int kThreads = 256;

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

template <typename T, int N, bool kInterleaved>
__global__ void
    swiglu_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t F, SwigluParams p) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    for (int64_t c = threadIdx.x * int64_t(N); c < F; c += int64_t(blockDim.x) * N) {
    float g[N], u[N];
    load_gate_linear<T, N, kInterleaved>(x + r * 2 * F, F, c, g, u);
    Pack<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      out.v[k] = from_float<T>(swiglu_forward(g[k], u[k], p));
    }
    *reinterpret_cast<Pack<T, N>*>(y + r * F + c) = out;
    }
  }
}

template <typename T, int N, bool kInterleaved>
__global__ void
    swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, int64_t rows,
                           int64_t F, SwigluParams p) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; r < rows; r += int64_t(gridDim.x) * blockDim.y) {
    for (int64_t c = threadIdx.x * int64_t(N); c < F; c += int64_t(blockDim.x) * N) {
    float g[N], u[N], dg[N], du[N];
    load_gate_linear<T, N, kInterleaved>(x + r * 2 * F, F, c, g, u);
    const auto pdy = *reinterpret_cast<const Pack<T, N>*>(dy + r * F + c);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float d = to_float(pdy.v[k]);
      swiglu_backward(g[k], u[k], d, p, dg[k], du[k]);
    }
    T* dxr = dx + r * 2 * F;
    if (kInterleaved) {
      typename InterleavedPack<T, N>::type out;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        out.v[2 * k] = from_float<T>(dg[k]);
        out.v[2 * k + 1] = from_float<T>(du[k]);
      }
      *reinterpret_cast<typename InterleavedPack<T, N>::type*>(dxr + 2 * c) = out;
    } else {
      Pack<T, N> og, ou;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        og.v[k] = from_float<T>(dg[k]);
        ou.v[k] = from_float<T>(du[k]);
      }
      *reinterpret_cast<Pack<T, N>*>(dxr + c) = og;
      *reinterpret_cast<Pack<T, N>*>(dxr + F + c) = ou;
    }
    }
  }
}

}  // namespace fused_rl_ops
