// Launchers of the chosen_logprob CUDA row kernels (chosen_logprob/kernel.cuh); the GEMMs around
// them are cuBLAS calls made by the torch glue. Compiled by nvcc and by the kernels-on-CPU tests.
#include "chosen_logprob/kernel.cuh"
#include "chosen_logprob/kernel.h"
#include "common/launch.h"
#include "vocab_parallel/stats_rows.cuh"

namespace fused_rl_ops::chosen_logprob {

cudaError_t launch_chosen_logprob_stats_rows(const Params& p, cudaStream_t stream) {
  return launch_stats_rows(p, stream);
}

cudaError_t launch_chosen_logprob_grad_rows(const Params& p, DType grads_dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  if (p.cols >= (int64_t(1) << 30)) return cudaErrorInvalidValue;  // the kernel's columns are 32-bit
  // Several tokens per position: through entry_grads (kernel.cuh), which the caller provides.
  const bool entries = p.tokens_per_row > 1;
  if (entries && p.entry_grads == nullptr) return cudaErrorInvalidValue;
  const int64_t entry_blocks = (p.rows + kEntryThreads - 1) / kEntryThreads;
  auto* entry_grads = static_cast<float*>(p.entry_grads);
  cudaError_t err = cudaSuccess;
  if (entries) {
    with_logit_map<float>(p.logit_map, [&](auto logit) {
      err = launch_grid_stride(chosen_logprob_gather_entry_grads_kernel<decltype(logit)>, entry_blocks, kEntryThreads,
                               0, stream, static_cast<const float*>(p.logits), p.rows, p.cols, p.col0, p.tokens,
                               p.tokens_per_row, static_cast<const float*>(p.row_max),
                               static_cast<const float*>(p.log_sum), static_cast<const float*>(p.log_sum_minus_entropy),
                               static_cast<const float*>(p.grad_logprob), static_cast<const float*>(p.grad_entropy),
                               static_cast<const float*>(p.threshold), logit, entry_grads);
    });
    if (err != cudaSuccess) return err;
  }
  // The grad kernel's tokens and logprob gradients: the row's one, or none and the summed G.
  const int64_t* tokens = entries ? nullptr : p.tokens;
  const auto* gl = static_cast<const float*>(entries ? p.entry_grads : p.grad_logprob);
  dispatch_dtype(grads_dtype, [&](auto* type_tag) {
    using G = std::remove_pointer_t<decltype(type_tag)>;
    // kGradWidth columns per access where every row of logits and grads starts aligned for it.
    const bool vectorised = p.cols % kGradWidth == 0 && p.grads_stride % kGradWidth == 0 &&
                            is_aligned(p.logits, sizeof(Pack<float, kGradWidth>)) &&
                            is_aligned(p.grads, sizeof(Pack<G, kGradWidth>));
    with_logit_map<float>(p.logit_map, [&](auto logit) {
      const auto launch = [&](auto width) {
        constexpr int kWidth = decltype(width)::value;
        const RowLaunch cfg = row_launch(p.rows, p.cols / kWidth, kGradThreads);
        err = launch_grid_stride(chosen_logprob_grad_rows_kernel<decltype(logit), G, kWidth>, cfg.work_blocks,
                                 cfg.block, 0, stream, static_cast<const float*>(p.logits), p.rows, p.cols, p.col0,
                                 tokens, static_cast<const float*>(p.row_max), static_cast<const float*>(p.log_sum),
                                 static_cast<const float*>(p.log_sum_minus_entropy), gl,
                                 static_cast<const float*>(p.grad_entropy), static_cast<const float*>(p.threshold),
                                 logit, static_cast<G*>(p.grads), p.grads_stride);
      };
      if (vectorised) launch(std::integral_constant<int, kGradWidth>{});
      else launch(std::integral_constant<int, 1>{});
    });
    if (entries && err == cudaSuccess) {
      err = launch_grid_stride(chosen_logprob_scatter_entry_grads_kernel<G>, entry_blocks, kEntryThreads, 0, stream,
                               p.rows, p.cols, p.col0, p.tokens, p.tokens_per_row,
                               static_cast<const float*>(p.entry_grads), static_cast<G*>(p.grads), p.grads_stride);
    }
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_chosen_logprob_combine(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0) return cudaSuccess;
  const cudaError_t err = launch_grid_stride(chosen_logprob_combine_kernel, (N + kCombineThreads - 1) / kCombineThreads,
                                             kCombineThreads, 0, stream, static_cast<const float*>(p.partials), p.ranks,
                                             N, stats_column::chosen + p.tokens_per_row, static_cast<float*>(p.out));
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_chosen_logprob_top_rows(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0 || p.cols == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  with_logit_map<float>(p.logit_map, [&](auto logit) {
    err = launch_grid_stride(chosen_logprob_top_rows_kernel<decltype(logit)>,
                             (N + kTopRowsPerBlock - 1) / kTopRowsPerBlock, kTopRowsPerBlock * kWarp, 0, stream,
                             static_cast<const float*>(p.logits), N, p.cols, logit,
                             static_cast<const float*>(p.threshold), static_cast<const double*>(p.window),
                             static_cast<float*>(p.top), p.top_width);
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_chosen_logprob_hist_rows(const Params& p, cudaStream_t stream) {
  const int64_t N = p.rows;
  if (N == 0 || p.cols == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  with_logit_map<float>(p.logit_map, [&](auto logit) {
    err = launch_grid_stride(chosen_logprob_hist_rows_kernel<decltype(logit)>, N, kHistThreads, 0, stream,
                             static_cast<const float*>(p.logits), N, p.cols, logit,
                             static_cast<const float*>(p.row_max), static_cast<const double*>(p.window),
                             static_cast<int64_t*>(p.hist));
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace fused_rl_ops::chosen_logprob
