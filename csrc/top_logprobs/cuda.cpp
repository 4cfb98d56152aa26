// top_logprobs, CUDA: the op of top_logprobs/entry.h with cuBLAS GEMMs through ATen
// (vocab_parallel/cuda_gemms.h) and the row kernels of top_logprobs/kernel.cu (which stays free of
// torch headers, one kernel for the stats and the top) on the current stream.
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include "top_logprobs/entry.h"
#include "top_logprobs/kernel.h"
#include "vocab_parallel/cuda_gemms.h"

namespace fused_rl_ops::top_logprobs {
namespace {

// The op's checks leave fp32 the only accumulation dtype on CUDA.
struct CudaKernels : CudaGemms {
  static void stats_top_ids_rows(const Params& p, at::ScalarType) {
    C10_CUDA_CHECK(launch_top_logprobs_stats_top_ids_rows(p, stream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) { m.impl("top_logprobs_stats", &stats<CudaKernels>); }

}  // namespace fused_rl_ops::top_logprobs
