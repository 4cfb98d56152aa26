// Launchers of the value-head CUDA kernels (value_head/kernel.cuh). Compiled by nvcc and by the
// kernels-on-CPU tests.
#include "common/launch.h"
#include "value_head/kernel.cuh"
#include "value_head/kernel.h"

namespace fused_rl_ops::value_head {
namespace {

void sum_partials(const float* partials, float* out, int64_t blocks, int64_t cols, cudaStream_t stream) {
  const auto grid = static_cast<unsigned>((cols + kWarp - 1) / kWarp);
  launch_kernel(value_head_sum_partials_kernel, grid, dim3(kWarp, kSumSlices), 0, stream, partials, out, blocks, cols);
}

}  // namespace

cudaError_t launch_value_head_forward(const void* hidden, const float* weight, const float* bias, float* out,
                                      int64_t rows, int64_t H, DType dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  return launch_with_width<16>(dtype, H, {hidden, weight}, [&](auto* type_tag, auto width) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    constexpr int N = decltype(width)::value;
    const unsigned grid = grid_for((rows + kForwardWarps - 1) / kForwardWarps, kWarp * kForwardWarps, dev);
    launch_kernel(value_head_forward_kernel<T, N>, grid, dim3(kWarp, kForwardWarps), 0, stream,
                  static_cast<const T*>(hidden), weight, bias, out, rows, H);
  });
}

cudaError_t launch_value_head_backward_hidden(const float* grad_out, const float* weight, void* grad_hidden,
                                              int64_t rows, int64_t H, DType dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  return launch_with_width<16>(dtype, H, {weight, grad_hidden}, [&](auto* type_tag, auto width) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    constexpr int N = decltype(width)::value;
    const RowLaunch cfg = row_launch(rows, H / N, kBroadcastThreads, dev);
    launch_kernel(value_head_backward_hidden_kernel<T, N>, cfg.grid, cfg.block, 0, stream, grad_out, weight,
                  static_cast<T*>(grad_hidden), rows, H);
  });
}

cudaError_t launch_value_head_backward_params(const float* grad_out, const void* hidden, float* weight_partials,
                                              float* bias_partials, float* grad_weight, float* grad_bias,
                                              int64_t rows, int64_t H, DType dtype, cudaStream_t stream) {
  const int64_t blocks = value_head_row_blocks(rows);
  if (blocks > 0) {
    const cudaError_t err = launch_with_width<16>(dtype, H, {hidden, weight_partials}, [&](auto* type_tag, auto width) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int N = decltype(width)::value;
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((H / N + kWarp - 1) / kWarp));
      launch_kernel(value_head_partials_kernel<T, N>, grid, dim3(kWarp, kStage1Warps), 0, stream, grad_out,
                    static_cast<const T*>(hidden), weight_partials, bias_partials, rows, H);
    });
    if (err != cudaSuccess) return err;
  }
  sum_partials(weight_partials, grad_weight, blocks, H, stream);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  sum_partials(bias_partials, grad_bias, blocks, 1, stream);
  return cudaGetLastError();
}

}  // namespace fused_rl_ops::value_head
