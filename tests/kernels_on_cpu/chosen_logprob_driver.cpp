// Runs chosen_logprob's CUDA row kernels (csrc/chosen_logprob/kernel.cuh) on the CPU, with the launch
// shapes of chosen_logprob/kernel.cu (the grid: the case's, or the launcher's for one pass).
#include "driver.h"
#include "chosen_logprob/kernel.cuh"

using namespace fused_rl_ops;
using namespace fused_rl_ops::chosen_logprob;
using cuda_on_host::launch;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t N = c.i("N");
    if (c.kernel == "stats_rows") {
      const int threads = kStatsRowsPerBlock * kWarp;
      const dim3 grid = c.row_grid(N, kStatsRowsPerBlock, grid_for((N + kStatsRowsPerBlock - 1) / kStatsRowsPerBlock, threads,
                                                              driver::kLargeDevice));
      launch(chosen_logprob_stats_rows_kernel, grid, threads, 0, c.buf<float>("logits"), N, c.i("C"), c.i("col0"),
             c.buf<int64_t>("tokens"), c.f("inv_temp"), c.buf<float>("stats"));
    } else if (c.kernel == "grad_rows") {
      const RowLaunch cfg = row_launch(N, c.i("C"), 256, driver::kLargeDevice);
      launch(chosen_logprob_grad_rows_kernel, c.row_grid(N, cfg.block.y, cfg.grid), cfg.block, 0, c.buf<float>("logits"), N,
             c.i("C"), c.i("col0"), c.buf<int64_t>("tokens"), c.buf<float>("row_max"), c.buf<float>("lse"),
             c.buf<float>("mean"), c.buf<float>("gl"), c.buf<float>("ge"), c.f("inv_temp"));
    } else if (c.kernel == "combine") {
      const dim3 grid = c.row_grid(N, 256, grid_for((N + 255) / 256, 256, driver::kLargeDevice));
      launch(chosen_logprob_combine_kernel, grid, 256, 0, c.buf<float>("partials"), c.i("ranks"), N, c.buf<float>("out"));
    } else {
      cuda_on_host::fail("unknown kernel " + c.kernel);
    }
    return cudaGetLastError();
  });
}
