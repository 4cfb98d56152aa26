// Clamped SwiGLU, CUDA entry points: checks, allocation and stream; the kernels live in
// swiglu_kernel.cu, which stays free of torch headers.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "swiglu_checks.h"
#include "swiglu_kernel.h"
#include "torch_utils.h"

namespace fused_rl_ops {
namespace {

at::Tensor clamped_swiglu_cuda(const at::Tensor& x_in, std::optional<double> limit, double alpha,
                               double linear_offset, bool interleaved) {
  check_swiglu_input(x_in);
  const SwigluParams p = swiglu_params(limit, alpha, linear_offset);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(swiglu_out_shape(x), x.options());
  const int64_t F = y.size(-1), rows = F == 0 ? 0 : y.numel() / F;
  C10_CUDA_CHECK(launch_swiglu_forward(x.const_data_ptr(), y.mutable_data_ptr(), rows, F, to_dtype(x), interleaved, p, c10::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor clamped_swiglu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x_in,
                                        std::optional<double> limit, double alpha, double linear_offset,
                                        bool interleaved) {
  check_swiglu_input(x_in);
  const SwigluParams p = swiglu_params(limit, alpha, linear_offset);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(swiglu_out_shape(x_in)) &&
                  grad_out.scalar_type() == x_in.scalar_type() && grad_out.device() == x_in.device(),
              "clamped_swiglu_backward: grad_out must match the output's shape, dtype and device");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = grad_out.contiguous();
  at::Tensor dx = at::empty_like(x);
  const int64_t F = dy.size(-1), rows = F == 0 ? 0 : dy.numel() / F;
  C10_CUDA_CHECK(launch_swiglu_backward(dy.const_data_ptr(), x.const_data_ptr(), dx.mutable_data_ptr(), rows, F,
                                        to_dtype(x), interleaved, p,
                                        c10::cuda::getCurrentCUDAStream()));
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("clamped_swiglu", &clamped_swiglu_cuda);
  m.impl("clamped_swiglu_backward", &clamped_swiglu_backward_cuda);
}

}  // namespace fused_rl_ops
