// Launchers of the chosen_logprob CUDA row kernels (logprob_kernel.cuh); the GEMMs around them are
// cuBLAS calls made by the torch glue.
#include "logprob_kernel.cuh"
#include "logprob_kernel.h"

namespace fused_rl_ops {

cudaError_t launch_logprob_stats_rows(const float* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                                      float inv_temp, float* stats, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const int threads = kRowsPerBlock * kWarp;
  stats_rows_kernel<<<grid_for((N + kRowsPerBlock - 1) / kRowsPerBlock, threads, dev), threads, 0, stream>>>(
      logits, N, C, col0, tokens, inv_temp, stats);
  return cudaGetLastError();
}

cudaError_t launch_logprob_grad_rows(float* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                                     const float* row_max, const float* lse, const float* mean, const float* gl,
                                     const float* ge, float inv_temp, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  const RowLaunch cfg = row_launch(N, C, 256, dev);
  grad_rows_kernel<<<cfg.grid, cfg.block, 0, stream>>>(logits, N, C, col0, tokens, row_max, lse, mean, gl, ge,
                                                       inv_temp);
  return cudaGetLastError();
}

cudaError_t launch_logprob_combine(const float* partials, int64_t ranks, int64_t N, float* out, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  DeviceSize dev;
  if (const cudaError_t err = current_device_size(dev); err != cudaSuccess) return err;
  combine_kernel<<<grid_for((N + 255) / 256, 256, dev), 256, 0, stream>>>(partials, ranks, N, out);
  return cudaGetLastError();
}

}  // namespace fused_rl_ops
