// Launchers of the chosen_logprob CUDA row kernels (chosen_logprob/kernel.cuh); the GEMMs around
// them are cuBLAS calls made by the torch glue. Compiled by nvcc and by the kernels-on-CPU tests.
#include "chosen_logprob/kernel.cuh"
#include "chosen_logprob/kernel.h"
#include "common/launch.h"

namespace fused_rl_ops::chosen_logprob {

cudaError_t launch_chosen_logprob_stats_rows(const float* logits, int64_t N, int64_t C, int64_t col0,
                                             const int64_t* tokens, double temperature, double softcap, float* stats,
                                             cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const int threads = kStatsRowsPerBlock * kWarp;
  const unsigned grid = grid_for((N + kStatsRowsPerBlock - 1) / kStatsRowsPerBlock, threads, dev);
  with_logit_map<float>(temperature, softcap, [&](auto logit) {
    launch_kernel(chosen_logprob_stats_rows_kernel<decltype(logit)>, grid, threads, 0, stream, logits, N, C, col0,
                  tokens, logit, stats);
  });
  return cudaGetLastError();
}

cudaError_t launch_chosen_logprob_grad_rows(float* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                                            const float* row_max, const float* lse, const float* mean,
                                            const float* gl, const float* ge, double temperature, double softcap,
                                            cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const RowLaunch cfg = row_launch(N, C, kGradThreads, dev);
  with_logit_map<float>(temperature, softcap, [&](auto logit) {
    launch_kernel(chosen_logprob_grad_rows_kernel<decltype(logit)>, cfg.grid, cfg.block, 0, stream, logits, N, C,
                  col0, tokens, row_max, lse, mean, gl, ge, logit);
  });
  return cudaGetLastError();
}

cudaError_t launch_chosen_logprob_combine(const float* partials, int64_t ranks, int64_t N, float* out,
                                          cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const unsigned grid = grid_for((N + kCombineThreads - 1) / kCombineThreads, kCombineThreads, dev);
  launch_kernel(chosen_logprob_combine_kernel, grid, kCombineThreads, 0, stream, partials, ranks, N, out);
  return cudaGetLastError();
}

}  // namespace fused_rl_ops::chosen_logprob
