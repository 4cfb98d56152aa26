// Launchers of top_logprobs' CUDA row kernels (top_logprobs/kernel.cuh, and the shared stats kernel);
// the GEMMs around them are cuBLAS calls made by the torch glue. Compiled by nvcc and by the
// kernels-on-CPU tests.
#include "common/launch.h"
#include "top_logprobs/kernel.cuh"
#include "top_logprobs/kernel.h"
#include "vocab_parallel/stats_rows.cuh"

namespace fused_rl_ops::top_logprobs {

cudaError_t launch_top_logprobs_stats_rows(const Params& p, cudaStream_t stream) {
  return launch_stats_rows(p, stream);
}

cudaError_t launch_top_logprobs_top_ids_rows(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0 || p.cols == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  with_logit_map<float>(p.logit_map, [&](auto logit) {
    err = launch_grid_stride(top_logprobs_top_ids_rows_kernel<decltype(logit)>,
                             (N + kTopIdsRowsPerBlock - 1) / kTopIdsRowsPerBlock, kTopIdsRowsPerBlock * kWarp, 0,
                             stream, static_cast<const float*>(p.logits), N, p.cols, p.col0, logit,
                             static_cast<float*>(p.top), p.top_ids, p.top_width);
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace fused_rl_ops::top_logprobs
