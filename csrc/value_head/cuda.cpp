// Value head on CUDA: the ops of value_head/entry.h with the launchers of value_head/kernel.cu
// (which stays free of torch headers) on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "value_head/entry.h"
#include "value_head/kernel.h"

namespace fused_rl_ops::value_head {
namespace {

struct CudaKernels {
  static void forward(const Params& p, const at::Tensor& hidden) {
    C10_CUDA_CHECK(launch_value_head_forward(p, to_dtype(hidden), c10::cuda::getCurrentCUDAStream()));
  }
  static void backward_hidden(const Params& p, const at::Tensor& grad_hidden) {
    C10_CUDA_CHECK(launch_value_head_backward_hidden(p, to_dtype(grad_hidden), c10::cuda::getCurrentCUDAStream()));
  }
  static void backward_params(const Params& p, const at::Tensor& hidden) {
    C10_CUDA_CHECK(launch_value_head_backward_params(p, to_dtype(hidden), c10::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("value_head", &forward<CudaKernels>);
  m.impl("value_head_backward_hidden", &backward_hidden<CudaKernels>);
  m.impl("value_head_backward_params", &backward_params<CudaKernels>);
}

}  // namespace fused_rl_ops::value_head
