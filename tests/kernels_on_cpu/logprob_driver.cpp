// Runs chosen_logprob's CUDA row kernels (csrc/logprob_kernel.cuh) on the CPU; the block shapes
// are logprob_kernel.cu's, the grid is the case's.
#include "driver.h"
#include "logprob_kernel.cuh"

using namespace fused_rl_ops;
using cuda_on_host::launch;

int main(int argc, char** argv) {
  return driver::main(argc, argv, [](driver::Case& c) {
    const int64_t N = c.i("N");
    if (c.kernel == "stats_rows") {
      launch(stats_rows_kernel, c.grid, kRowsPerBlock * kWarp, 0, c.buf<float>("logits"), N, c.i("C"), c.i("col0"),
             c.buf<int64_t>("tokens"), c.f("inv_temp"), c.buf<float>("stats"));
    } else if (c.kernel == "grad_rows") {
      const dim3 block = row_launch(N, c.i("C"), 256, DeviceSize{}).block;
      launch(grad_rows_kernel, c.grid, block, 0, c.buf<float>("logits"), N, c.i("C"), c.i("col0"),
             c.buf<int64_t>("tokens"), c.buf<float>("lse"), c.buf<float>("mean"), c.buf<float>("gl"),
             c.buf<float>("ge"), c.f("inv_temp"));
    } else if (c.kernel == "combine") {
      launch(combine_kernel, c.grid, 256, 0, c.buf<float>("partials"), c.i("ranks"), N, c.buf<float>("out"));
    } else {
      cuda_on_host::fail("unknown kernel " + c.kernel);
    }
    return cudaGetLastError();
  });
}
