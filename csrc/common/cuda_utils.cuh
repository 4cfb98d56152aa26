// Small device helpers shared by the .cu files (no torch headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <map>
#include <mutex>
#include <type_traits>

#include "common/math.h"

namespace fused_rl_ops {

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

constexpr int kWarp = 32;

// Sum over a warp, in the same butterfly order on every call (deterministic); every lane gets the
// total. kGroups: over each group of `width` consecutive lanes instead (width a power of two, at
// most kWarp), every lane getting its group's total; without it the width test is compiled out.
template <bool kGroups = false>
__device__ __forceinline__ float warp_sum(float v, int width = kWarp) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    if (!kGroups || offset < width) v += __shfl_xor_sync(0xffffffffu, v, offset);  // stays within a group
  }
  return v;
}

// Max over a warp (NaN-propagating, as Math<float>::max), in a fixed butterfly order; every lane
// gets it.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = Math<float>::max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// N elements moved as one aligned load or store (16 bytes at most).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

inline bool is_aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// What launch shapes need of a device, read from its properties.
struct DeviceSize {
  int sms = 0;
  int threads_per_sm = 0;  // resident threads per SM: 2048 on sm_80 / sm_90, 1536 on sm_86 / sm_89
};

// The current device's DeviceSize, queried once per device (thread-safe). A failing runtime call
// returns its error; nothing is guessed.
inline cudaError_t current_device_size(DeviceSize& out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  static std::mutex mu;
  static std::map<int, DeviceSize> known;
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(dev);
    if (it != known.end()) {
      out = it->second;
      return cudaSuccess;
    }
  }
  DeviceSize size;
  err = cudaDeviceGetAttribute(&size.sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&size.threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev);
  }
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mu);
  known.emplace(dev, size);
  out = size;
  return cudaSuccess;
}

// Grid for a grid-stride loop over `work` blocks of `threads`: enough to fill the device, no more.
inline unsigned grid_for(int64_t work_blocks, int threads, const DeviceSize& dev) {
  const int64_t resident = dev.threads_per_sm / threads;
  const int64_t max_blocks = int64_t(dev.sms) * (resident > 0 ? resident : 1);
  return static_cast<unsigned>(work_blocks < 1 ? 1 : (work_blocks < max_blocks ? work_blocks : max_blocks));
}

// Block of `threads` laid out [rows, columns] for a [rows, cols] loop, columns first: up to all
// threads along a row, the rest over rows; the grid strides over rows.
struct RowLaunch {
  dim3 grid, block;
};
inline RowLaunch row_launch(int64_t rows, int64_t cols, int threads, const DeviceSize& dev) {
  int tx = 1;
  while (tx < threads && tx < cols) tx *= 2;
  const int ty = threads / tx;
  return {dim3(grid_for((rows + ty - 1) / ty, threads, dev)), dim3(tx, ty)};
}

// Calls fn with a null pointer of the element type named by dt.
template <typename Fn>
void dispatch_dtype(DType dt, const Fn& fn) {
  switch (dt) {
    case DType::kFloat32: fn(static_cast<float*>(nullptr)); break;
    case DType::kBFloat16: fn(static_cast<__nv_bfloat16*>(nullptr)); break;
    case DType::kFloat16: fn(static_cast<__half*>(nullptr)); break;
  }
}

// Calls launch(type_tag, width) for the element type named by dt: width = kBytes / sizeof(T)
// elements per thread when rows of row_len elements and every pointer keep those accesses 16-byte
// aligned, else width 1 (the scalar path).
template <int kBytes, typename Launch>
cudaError_t launch_with_width(DType dt, int64_t row_len, std::initializer_list<const void*> ptrs,
                              const Launch& launch) {
  dispatch_dtype(dt, [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    constexpr int wide = kBytes / int(sizeof(T));
    bool vectorised = row_len % wide == 0;
    for (const void* p : ptrs) vectorised = vectorised && is_aligned(p, 16);
    if (vectorised) launch(type_tag, std::integral_constant<int, wide>{});
    else launch(type_tag, std::integral_constant<int, 1>{});
  });
  return cudaGetLastError();
}

}  // namespace fused_rl_ops
