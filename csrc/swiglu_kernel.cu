// Launchers of the clamped SwiGLU CUDA kernels (swiglu_kernel.cuh).
#include "swiglu_kernel.cuh"
#include "swiglu_kernel.h"

namespace fused_rl_ops {

cudaError_t launch_swiglu_forward(const void* x, void* y, int64_t rows, int64_t F, DType dtype, bool interleaved,
                                  SwigluParams p, cudaStream_t stream) {
  if (rows * F == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  auto run = [&](auto interleaved_tag) {
    constexpr bool kInter = decltype(interleaved_tag)::value;
    return launch_with_width<kInter ? 8 : 16>(dtype, F, {x, y}, [&](auto* type_tag, auto width) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int N = decltype(width)::value;
      const RowLaunch cfg = row_launch(rows, F / N, kThreads, dev);
      swiglu_forward_kernel<T, N, kInter><<<cfg.grid, cfg.block, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), rows, F, p);
    });
  };
  return interleaved ? run(std::true_type{}) : run(std::false_type{});
}

cudaError_t launch_swiglu_backward(const void* dy, const void* x, void* dx, int64_t rows, int64_t F, DType dtype,
                                   bool interleaved, SwigluParams p, cudaStream_t stream) {
  if (rows * F == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  auto run = [&](auto interleaved_tag) {
    constexpr bool kInter = decltype(interleaved_tag)::value;
    return launch_with_width<kInter ? 8 : 16>(dtype, F, {dy, x, dx}, [&](auto* type_tag, auto width) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int N = decltype(width)::value;
      const RowLaunch cfg = row_launch(rows, F / N, kThreads, dev);
      swiglu_backward_kernel<T, N, kInter><<<cfg.grid, cfg.block, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx), rows, F, p);
    });
  };
  return interleaved ? run(std::true_type{}) : run(std::false_type{});
}

}  // namespace fused_rl_ops
