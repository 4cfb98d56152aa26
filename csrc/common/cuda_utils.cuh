// Small device helpers shared by the .cu files (no torch headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
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

// The unsigned integer of kBytes bytes.
template <int kBytes>
struct UnsignedOf;
template <>
struct UnsignedOf<2> {
  using type = uint16_t;
};
template <>
struct UnsignedOf<4> {
  using type = uint32_t;
};
template <>
struct UnsignedOf<8> {
  using type = uint64_t;
};
template <>
struct UnsignedOf<16> {
  using type = unsigned __int128;
};

// Stores v at p (aligned for it) with one store instruction of its size (STG.E.64 / .128 for 8 /
// 16 bytes): its bits gathered into one unsigned integer. nvcc splits a store of the Pack itself,
// or of a uint2 / uint4, into one store per element or 32-bit word.
template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  using Element = typename UnsignedOf<int(sizeof(T))>::type;
  using Bits = typename UnsignedOf<int(sizeof(Pack<T, N>))>::type;
  Bits bits = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    Element e;
    memcpy(&e, &v.v[i], sizeof(T));
    bits |= Bits(e) << (8 * sizeof(T) * i);
  }
  *reinterpret_cast<Bits*>(p) = bits;
}

// The block's dynamic shared memory (its launch's shared_bytes; the kernels-on-CPU tests' host
// model gives each block running at once its own).
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
#if defined(CUDA_ON_HOST)
  return static_cast<unsigned char*>(cuda_on_host::dynamic_shared());
#else
  extern __shared__ __align__(16) unsigned char block_shared_bytes[];
  return block_shared_bytes;
#endif
}

inline bool is_aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// What launch shapes need of a device, read from its properties.
struct DeviceSize {
  int sms = 0;
};

// query(value)'s value for key, cached (thread-safe; a cache per call site): a failing query
// returns its error and caches nothing.
template <typename Key, typename Value, typename Query>
cudaError_t cached(const Key& key, Value& out, const Query& query) {
  static std::mutex mu;
  static std::map<Key, Value> known;
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(key);
    if (it != known.end()) {
      out = it->second;
      return cudaSuccess;
    }
  }
  Value value;
  if (const cudaError_t err = query(value); err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mu);
  out = known.emplace(key, value).first->second;
  return cudaSuccess;
}

// The current device's DeviceSize, queried once per device. A failing runtime call returns its
// error; nothing is guessed.
inline cudaError_t current_device_size(DeviceSize& out) {
  int dev = 0;
  if (const cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  return cached(dev, out, [dev](DeviceSize& size) {
    return cudaDeviceGetAttribute(&size.sms, cudaDevAttrMultiProcessorCount, dev);
  });
}

// The blocks of kernel, `threads` threads and shared_bytes of dynamic shared memory each, that the
// current device holds at once: its SMs times the occupancy calculator's blocks per SM, which counts
// the kernel's registers and shared memory (at least 1: a kernel that fits none fails at launch).
// Cached per kernel, device and block; a failing runtime call returns its error.
inline cudaError_t resident_blocks(const void* kernel, int threads, size_t shared_bytes, int64_t& out) {
  int dev = 0;
  if (const cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  const std::tuple<const void*, int, int, size_t> key{kernel, dev, threads, shared_bytes};
  return cached(key, out, [&](int64_t& blocks) {
    DeviceSize size;
    int per_sm = 0;
    cudaError_t err = current_device_size(size);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes);
    blocks = int64_t(size.sms) * (per_sm > 0 ? per_sm : 1);
    return err;
  });
}

// Grid for a grid-stride loop of kernel over work_blocks blocks: enough to fill the device
// (resident_blocks), no more.
template <typename... Params>
cudaError_t grid_for(void (*kernel)(Params...), int64_t work_blocks, dim3 block, size_t shared_bytes, unsigned& grid) {
  int64_t max_blocks = 0;
  const int threads = int(block.x * block.y * block.z);
  const cudaError_t err = resident_blocks(reinterpret_cast<const void*>(kernel), threads, shared_bytes, max_blocks);
  if (err != cudaSuccess) return err;
  grid = static_cast<unsigned>(work_blocks < 1 ? 1 : (work_blocks < max_blocks ? work_blocks : max_blocks));
  return cudaSuccess;
}

// Block of `threads` laid out [rows, columns] for a [rows, cols] loop, columns first: up to all
// threads along a row, the rest over rows; the grid strides over work_blocks row tiles.
struct RowLaunch {
  dim3 block;
  int64_t work_blocks;
};
inline RowLaunch row_launch(int64_t rows, int64_t cols, int threads) {
  int tx = 1;
  while (tx < threads && tx < cols) tx *= 2;
  const int ty = threads / tx;
  return {dim3(tx, ty), (rows + ty - 1) / ty};
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
