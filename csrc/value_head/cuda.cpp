// Value head, CUDA entry points: checks, allocation and stream; the kernels live in
// value_head/kernel.cu, which stays free of torch headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/torch_utils.h"
#include "value_head/args.h"
#include "value_head/kernel.h"

namespace fused_rl_ops::value_head {
namespace {

at::Tensor value_head_cuda(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                           const std::optional<at::Tensor>& bias_in) {
  check_value_head_args(hidden_in, weight_in, bias_in);
  const DType dtype = to_dtype(hidden_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), weight = value_head_weight(weight_in, at::kFloat);
  const at::Tensor bias = bias_in ? bias_in->to(at::kFloat) : at::Tensor();
  at::Tensor out = at::empty(value_head_out_shape(hidden.sizes()), hidden.options().dtype(at::kFloat));
  C10_CUDA_CHECK(launch_value_head_forward(hidden.const_data_ptr(), weight.const_data_ptr<float>(),
                                           bias.defined() ? bias.const_data_ptr<float>() : nullptr,
                                           out.mutable_data_ptr<float>(), out.numel(), hidden.size(-1), dtype,
                                           c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor value_head_backward_hidden_cuda(const at::Tensor& grad_out_in, const at::Tensor& weight_in,
                                           at::ScalarType hidden_dtype) {
  const auto hidden_shape = backward_hidden_shape(grad_out_in, weight_in, hidden_dtype);
  const int64_t H = hidden_shape.back();
  const c10::cuda::CUDAGuard guard(grad_out_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), weight = value_head_weight(weight_in, at::kFloat);
  at::Tensor grad_hidden = at::empty(hidden_shape, grad_out.options().dtype(hidden_dtype));
  C10_CUDA_CHECK(launch_value_head_backward_hidden(grad_out.const_data_ptr<float>(), weight.const_data_ptr<float>(),
                                                   grad_hidden.mutable_data_ptr(), grad_out.numel(), H,
                                                   to_dtype(grad_hidden), c10::cuda::getCurrentCUDAStream()));
  return grad_hidden;
}

std::tuple<at::Tensor, at::Tensor> value_head_backward_params_cuda(const at::Tensor& grad_out_in,
                                                                   const at::Tensor& hidden_in) {
  check_backward_params_args(grad_out_in, hidden_in);
  const DType dtype = to_dtype(hidden_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), grad_out = grad_out_in.contiguous();
  const int64_t H = hidden.size(-1), rows = grad_out.numel(), blocks = value_head_row_blocks(rows);
  const auto opts = grad_out.options();
  at::Tensor weight_partials = at::empty({blocks, H}, opts), bias_partials = at::empty({blocks}, opts);
  at::Tensor grad_weight = at::empty({H}, opts), grad_bias = at::empty({}, opts);
  C10_CUDA_CHECK(launch_value_head_backward_params(
      grad_out.const_data_ptr<float>(), hidden.const_data_ptr(), weight_partials.mutable_data_ptr<float>(),
      bias_partials.mutable_data_ptr<float>(), grad_weight.mutable_data_ptr<float>(),
      grad_bias.mutable_data_ptr<float>(), rows, H, dtype, c10::cuda::getCurrentCUDAStream()));
  return {grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_rl_ops, CUDA, m) {
  m.impl("value_head", &value_head_cuda);
  m.impl("value_head_backward_hidden", &value_head_backward_hidden_cuda);
  m.impl("value_head_backward_params", &value_head_backward_params_cuda);
}

}  // namespace fused_rl_ops::value_head
