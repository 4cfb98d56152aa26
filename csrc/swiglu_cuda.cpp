// Clamped SwiGLU, CUDA entry points: checks, allocation and stream; the kernels live in
// swiglu_kernel.cu, which stays free of torch headers.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "swiglu_args.h"
#include "swiglu_kernel.h"
#include "torch_utils.h"

namespace fused_rl_ops {
namespace {

at::Tensor clamped_swiglu_cuda(const at::Tensor& x, std::optional<double> limit, double alpha, double linear_offset,
                               bool interleaved) {
  const c10::cuda::CUDAGuard guard(x.device());
  const SwigluCall c = swiglu_forward_call(x, limit, alpha, linear_offset);
  C10_CUDA_CHECK(launch_swiglu_forward(c.x.const_data_ptr(), c.half.mutable_data_ptr(), c.rows, c.F, to_dtype(x),
                                       interleaved, c.p, c10::cuda::getCurrentCUDAStream()));
  return c.half;
}

at::Tensor clamped_swiglu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, std::optional<double> limit,
                                        double alpha, double linear_offset, bool interleaved) {
  const c10::cuda::CUDAGuard guard(x.device());
  const SwigluCall c = swiglu_backward_call(grad_out, x, limit, alpha, linear_offset);
  C10_CUDA_CHECK(launch_swiglu_backward(c.half.const_data_ptr(), c.x.const_data_ptr(), c.full.mutable_data_ptr(),
                                        c.rows, c.F, to_dtype(x), interleaved, c.p, c10::cuda::getCurrentCUDAStream()));
  return c.full;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("clamped_swiglu", &clamped_swiglu_cuda);
  m.impl("clamped_swiglu_backward", &clamped_swiglu_backward_cuda);
}

}  // namespace fused_rl_ops
