// Runs the value-head CUDA kernels (csrc/value_head/kernel.cuh) on the CPU, through
// launch_with_width and the launch shapes of value_head/kernel.cu; forward and backward_hidden
// stride over rows (the grid: the case's, or the launcher's for one pass), backward_params (both
// reduction stages) has a grid fixed by the work.
#include "driver.h"
#include "value_head/kernel.cuh"

using namespace fused_rl_ops;
using namespace fused_rl_ops::value_head;
using cuda_on_host::launch;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t rows = c.i("rows"), H = c.i("H");
    if (c.kernel == "forward") {
      const void* hidden = c.raw("hidden");
      const float* bias = c.i("has_bias") ? c.buf<float>("bias") : nullptr;
      return launch_with_width<16>(c.dtype(), H, {hidden, c.raw("weight")}, [&](auto* type_tag, auto width) {
        using T = std::remove_pointer_t<decltype(type_tag)>;
        constexpr int N = decltype(width)::value;
        std::cout << "width " << N << "\n";
        const dim3 grid = c.row_grid(rows, kForwardWarps, grid_for((rows + kForwardWarps - 1) / kForwardWarps,
                                                                   kWarp * kForwardWarps, driver::kLargeDevice));
        launch(value_head_forward_kernel<T, N>, grid, dim3(kWarp, kForwardWarps), 0, static_cast<const T*>(hidden),
               c.buf<float>("weight"), bias, c.buf<float>("out"), rows, H);
      });
    }
    if (c.kernel == "backward_hidden") {
      void* grad_hidden = c.raw("grad_hidden");
      return launch_with_width<16>(c.dtype(), H, {c.raw("weight"), grad_hidden}, [&](auto* type_tag, auto width) {
        using T = std::remove_pointer_t<decltype(type_tag)>;
        constexpr int N = decltype(width)::value;
        std::cout << "width " << N << "\n";
        const RowLaunch cfg = row_launch(rows, H / N, kBroadcastThreads, driver::kLargeDevice);
        launch(value_head_backward_hidden_kernel<T, N>, c.row_grid(rows, cfg.block.y, cfg.grid), cfg.block, 0,
               c.buf<float>("grad_out"), c.buf<float>("weight"), static_cast<T*>(grad_hidden), rows, H);
      });
    }
    if (c.kernel != "backward_params") cuda_on_host::fail("unknown kernel " + c.kernel);
    const void* hidden = c.raw("hidden");
    const int64_t blocks = value_head_row_blocks(rows);
    float *weight_partials = c.buf<float>("weight_partials"), *bias_partials = c.buf<float>("bias_partials");
    const auto partials = [&](auto* type_tag, auto width) {
      using T = std::remove_pointer_t<decltype(type_tag)>;
      constexpr int N = decltype(width)::value;
      std::cout << "width " << N << "\n";
      const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((H / N + kWarp - 1) / kWarp));
      launch(value_head_partials_kernel<T, N>, grid, dim3(kWarp, kStage1Warps), 0, c.buf<float>("grad_out"),
             static_cast<const T*>(hidden), weight_partials, bias_partials, rows, H);
    };
    const cudaError_t err = launch_with_width<16>(c.dtype(), H, {hidden, weight_partials}, partials);
    if (err != cudaSuccess) return err;
    const auto sum_partials = [&](const float* partials, float* out, int64_t cols) {
      launch(value_head_sum_partials_kernel, dim3(static_cast<unsigned>((cols + kWarp - 1) / kWarp)), dim3(kWarp, kSumSlices), 0,
             partials, out, blocks, cols);
      return cudaGetLastError();
    };
    const cudaError_t werr = sum_partials(weight_partials, c.buf<float>("grad_weight"), H);
    return werr != cudaSuccess ? werr : sum_partials(bias_partials, c.buf<float>("grad_bias"), 1);
  });
}
