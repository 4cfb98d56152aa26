// Clamped SwiGLU, CUDA entry points: checks, allocation and stream; the kernels live in
// clamped_swiglu/kernel.cu, which stays free of torch headers.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "clamped_swiglu/args.h"
#include "clamped_swiglu/kernel.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::clamped_swiglu {
namespace {

at::Tensor clamped_swiglu_cuda(const at::Tensor& x, std::optional<double> limit, double alpha, double linear_offset,
                               bool interleaved, const std::optional<at::Tensor>& scale) {
  const c10::cuda::CUDAGuard guard(x.device());
  const CallTensors c = forward_call(x, limit, alpha, linear_offset, scale);
  const float* s = c.scale.defined() ? c.scale.const_data_ptr<float>() : nullptr;
  C10_CUDA_CHECK(launch_clamped_swiglu_forward(c.x.const_data_ptr(), s, c.half.mutable_data_ptr(), c.rows, c.F,
                                               to_dtype(x), interleaved, c.p, c10::cuda::getCurrentCUDAStream()));
  return c.half;
}

at::Tensor clamped_swiglu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, std::optional<double> limit,
                                        double alpha, double linear_offset, bool interleaved) {
  const c10::cuda::CUDAGuard guard(x.device());
  const CallTensors c = backward_call(grad_out, x, limit, alpha, linear_offset);
  C10_CUDA_CHECK(launch_clamped_swiglu_backward(c.half.const_data_ptr(), c.x.const_data_ptr(),
                                                c.full.mutable_data_ptr(), c.rows, c.F, to_dtype(x), interleaved, c.p,
                                                c10::cuda::getCurrentCUDAStream()));
  return c.full;
}

std::tuple<at::Tensor, at::Tensor> clamped_swiglu_scaled_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                                       const at::Tensor& scale,
                                                                       std::optional<double> limit, double alpha,
                                                                       double linear_offset, bool interleaved) {
  const c10::cuda::CUDAGuard guard(x.device());
  const CallTensors c = scaled_backward_call(grad_out, x, scale, limit, alpha, linear_offset);
  at::Tensor grad_scale = scale_grad_buffer(c);
  C10_CUDA_CHECK(launch_clamped_swiglu_scaled_backward(c.half.const_data_ptr(), c.x.const_data_ptr(),
                                                       c.scale.const_data_ptr<float>(), c.full.mutable_data_ptr(),
                                                       grad_scale.mutable_data_ptr<float>(), c.rows, c.F, to_dtype(x),
                                                       interleaved, c.p, c10::cuda::getCurrentCUDAStream()));
  return {c.full, scale_grad(grad_scale, scale)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("clamped_swiglu", &clamped_swiglu_cuda);
  m.impl("clamped_swiglu_backward", &clamped_swiglu_backward_cuda);
  m.impl("clamped_swiglu_scaled_backward", &clamped_swiglu_scaled_backward_cuda);
}

}  // namespace fused_rl_ops::clamped_swiglu
