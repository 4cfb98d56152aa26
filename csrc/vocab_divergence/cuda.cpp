// vocab_divergence, CUDA: the ops of vocab_divergence/entry.h with cuBLAS GEMMs through ATen
// (vocab_parallel/cuda_gemms.h) and the row kernels of vocab_divergence/kernel.cu (which stays free of torch
// headers) on the current stream.
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include "vocab_divergence/entry.h"
#include "vocab_divergence/kernel.h"
#include "vocab_parallel/cuda_gemms.h"

namespace fused_rl_ops::vocab_divergence {
namespace {

// The ops' checks (entry.h) leave fp32 the only accumulation dtype on CUDA.
struct CudaKernels : CudaGemms {
  static void stats_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_vocab_divergence_stats_rows(p, stream()));
  }

  static void mixture_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_vocab_divergence_mixture_rows(p, stream()));
  }

  static void grad_rows(const Params& p, at::ScalarType, at::ScalarType grads) {
    C10_CUDA_CHECK(launch_vocab_divergence_grad_rows(p, to_dtype(grads), stream()));
  }

  static void combine(const Params& p, at::ScalarType) { C10_CUDA_CHECK(launch_vocab_divergence_combine(p, stream())); }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("vocab_divergence_stats", &stats<CudaKernels>);
  m.impl("vocab_divergence_combine", &combine<CudaKernels>);
  m.impl("vocab_divergence_mixture", &mixture<CudaKernels>);
  m.impl("vocab_divergence_backward", &backward<CudaKernels>);
}

}  // namespace fused_rl_ops::vocab_divergence
