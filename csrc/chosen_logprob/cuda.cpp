// chosen_logprob, CUDA: the ops of chosen_logprob/entry.h with cuBLAS GEMMs through ATen
// (vocab_parallel/cuda_gemms.h) and the row kernels of chosen_logprob/kernel.cu (which stays free of torch
// headers) on the current stream.
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include "chosen_logprob/entry.h"
#include "chosen_logprob/kernel.h"
#include "vocab_parallel/cuda_gemms.h"

namespace fused_rl_ops::chosen_logprob {
namespace {

// The ops' checks (entry.h) leave fp32 the only accumulation dtype on CUDA.
struct CudaKernels : CudaGemms {
  static void stats_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_chosen_logprob_stats_rows(p, stream()));
  }

  static void grad_rows(const Params& p, at::ScalarType, at::ScalarType grads) {
    C10_CUDA_CHECK(launch_chosen_logprob_grad_rows(p, to_dtype(grads), stream()));
  }

  static void top_rows(const Params& p, at::ScalarType) { C10_CUDA_CHECK(launch_chosen_logprob_top_rows(p, stream())); }

  static void hist_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_chosen_logprob_hist_rows(p, stream()));
  }

  static void combine(const Params& p, at::ScalarType) { C10_CUDA_CHECK(launch_chosen_logprob_combine(p, stream())); }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("chosen_logprob_stats", &stats<CudaKernels>);
  m.impl("chosen_logprob_backward", &backward<CudaKernels>);
  m.impl("chosen_logprob_combine", &combine<CudaKernels>);
  m.impl("chosen_logprob_search", &search<CudaKernels>);
}

}  // namespace fused_rl_ops::chosen_logprob
