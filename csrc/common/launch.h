// launch_kernel: how every launcher (<op>/kernel.cu) starts a kernel: kernel<<<...>>>(args...)
// under nvcc; on the host where the kernels-on-CPU tests compile the same launchers with g++ against
// their host model of CUDA (cuda_on_host.h, which defines CUDA_ON_HOST), so that they check the
// launchers' grids too.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/cuda_utils.cuh"

namespace fused_rl_ops {

template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                          Args&&... args) {
#if defined(__CUDACC__)
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
#elif defined(CUDA_ON_HOST)
  (void)stream;  // the host model runs launches one after another
  cuda_on_host::launch(kernel, grid, block, shared_bytes, std::forward<Args>(args)...);
#else
#error "kernel launches are compiled by nvcc, or by the kernels-on-CPU tests (cuda_on_host.h)"
#endif
}

// Launches kernel over a grid-stride loop of work_blocks blocks on as many blocks as the device
// holds at once (grid_for). Returns grid_for's error; a launch error is cudaGetLastError()'s.
template <typename... Params, typename... Args>
cudaError_t launch_grid_stride(void (*kernel)(Params...), int64_t work_blocks, dim3 block, size_t shared_bytes,
                               cudaStream_t stream, Args&&... args) {
  unsigned grid = 0;
  if (const cudaError_t err = grid_for(kernel, work_blocks, block, shared_bytes, grid); err != cudaSuccess) return err;
  launch_kernel(kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
  return cudaSuccess;
}

}  // namespace fused_rl_ops
