// Clamped SwiGLU on CUDA: the ops of clamped_swiglu/entry.h with the launchers of
// clamped_swiglu/kernel.cu (which stays free of torch headers) on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "clamped_swiglu/entry.h"
#include "clamped_swiglu/kernel.h"

namespace fused_rl_ops::clamped_swiglu {
namespace {

struct CudaKernels {
  static void forward(const Params& p, const at::Tensor& x) {
    C10_CUDA_CHECK(launch_clamped_swiglu_forward(p, to_dtype(x), c10::cuda::getCurrentCUDAStream()));
  }
  static void backward(const Params& p, const at::Tensor& x) {
    C10_CUDA_CHECK(launch_clamped_swiglu_backward(p, to_dtype(x), c10::cuda::getCurrentCUDAStream()));
  }
  static void scaled_backward(const Params& p, const at::Tensor& x) {
    C10_CUDA_CHECK(launch_clamped_swiglu_scaled_backward(p, to_dtype(x), c10::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("clamped_swiglu", &forward<CudaKernels>);
  m.impl("clamped_swiglu_backward", &backward<CudaKernels>);
  m.impl("clamped_swiglu_scaled_backward", &scaled_backward<CudaKernels>);
}

}  // namespace fused_rl_ops::clamped_swiglu
