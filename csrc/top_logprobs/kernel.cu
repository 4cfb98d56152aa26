// Launcher of top_logprobs' CUDA row kernel (top_logprobs/kernel.cuh); the GEMMs around it are
// cuBLAS calls made by the torch glue. Compiled by nvcc and by the kernels-on-CPU tests.
#include <type_traits>

#include "common/launch.h"
#include "top_logprobs/kernel.cuh"
#include "top_logprobs/kernel.h"

namespace fused_rl_ops::top_logprobs {

cudaError_t launch_top_logprobs_stats_top_ids_rows(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0 || p.cols == 0) return cudaSuccess;
  const bool vectorised = p.cols % kTopIdsWidth == 0 && is_aligned(p.logits, sizeof(Pack<float, kTopIdsWidth>));
  cudaError_t err = cudaSuccess;
  with_logit_map<float>(p.logit_map, [&](auto logit) {
    const auto launch = [&](auto width) {
      err = launch_grid_stride(top_logprobs_stats_top_ids_rows_kernel<decltype(logit), decltype(width)::value>,
                               (N + kTopIdsRowsPerBlock - 1) / kTopIdsRowsPerBlock, kTopIdsRowsPerBlock * kWarp,
                               top_shared_bytes(p.top_width), stream, static_cast<const float*>(p.logits), N, p.cols,
                               p.col0, logit, static_cast<float*>(p.stats), static_cast<float*>(p.top), p.top_ids,
                               p.top_width);
    };
    if (vectorised) launch(std::integral_constant<int, kTopIdsWidth>{});
    else launch(std::integral_constant<int, 1>{});
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace fused_rl_ops::top_logprobs
