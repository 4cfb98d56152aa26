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

cudaError_t launch_value_head_forward(const Params& p, DType dtype, cudaStream_t stream) {
  const int64_t rows = p.rows;
  if (rows == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  const cudaError_t launch_err = launch_with_width<16>(dtype, p.H, {p.hidden, p.weight}, [&](auto* type_tag,
                                                                                           auto width) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    constexpr int N = decltype(width)::value;
    err = launch_grid_stride(value_head_forward_kernel<T, N>, (rows + kForwardWarps - 1) / kForwardWarps,
                             dim3(kWarp, kForwardWarps), 0, stream, static_cast<const T*>(p.hidden),
                             static_cast<const float*>(p.weight), static_cast<const float*>(p.bias),
                             static_cast<float*>(p.out), rows, p.H);
  });
  return err != cudaSuccess ? err : launch_err;
}

cudaError_t launch_value_head_backward_hidden(const Params& p, DType dtype, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  const cudaError_t launch_err = launch_with_width<16>(dtype, p.H, {p.weight, p.grad_hidden}, [&](auto* type_tag,
                                                                                                auto width) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    constexpr int N = decltype(width)::value;
    const RowLaunch cfg = row_launch(p.rows, p.H / N, kBroadcastThreads);
    err = launch_grid_stride(value_head_backward_hidden_kernel<T, N>, cfg.work_blocks, cfg.block, 0, stream,
                             static_cast<const float*>(p.grad_out), static_cast<const float*>(p.weight),
                             static_cast<T*>(p.grad_hidden), p.rows, p.H);
  });
  return err != cudaSuccess ? err : launch_err;
}

cudaError_t launch_value_head_backward_params(const Params& p, DType dtype, cudaStream_t stream) {
  const int64_t H = p.H, blocks = value_head_row_blocks(p.rows);
  auto* weight_partials = static_cast<float*>(p.weight_partials);
  auto* bias_partials = static_cast<float*>(p.bias_partials);
  if (blocks > 0) {
    const cudaError_t err = launch_with_width<16>(dtype, H, {p.hidden, weight_partials}, [&](auto* type_tag,
                                                                                           auto width) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int N = decltype(width)::value;
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((H / N + kWarp - 1) / kWarp));
      launch_kernel(value_head_partials_kernel<T, N>, grid, dim3(kWarp, kStage1Warps), 0, stream,
                    static_cast<const float*>(p.grad_out), static_cast<const T*>(p.hidden), weight_partials,
                    bias_partials, p.rows, H);
    });
    if (err != cudaSuccess) return err;
  }
  sum_partials(weight_partials, static_cast<float*>(p.grad_weight), blocks, H, stream);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  sum_partials(bias_partials, static_cast<float*>(p.grad_bias), blocks, 1, stream);
  return cudaGetLastError();
}

}  // namespace fused_rl_ops::value_head
