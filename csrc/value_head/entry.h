// The value-head ops, one implementation for the CPU and CUDA kernels: argument checks, output
// allocation and the launch's Params. Kernels (cpu.cpp's, cuda.cpp's) runs a Params for the dtype of
// the tensor it is given; each device file registers these templates with its own Kernels.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "common/torch_utils.h"
#include "value_head/params.h"

namespace fused_rl_ops::value_head {

// weight: [H] or [1, H], fp32 or hidden's dtype.
inline void check_value_head_weight(const at::Tensor& weight, int64_t H, at::ScalarType hidden_dtype) {
  const bool shape_ok = (weight.dim() == 1 && weight.size(0) == H) ||
                        (weight.dim() == 2 && weight.size(0) == 1 && weight.size(1) == H);
  TORCH_CHECK(shape_ok, "value_head: weight must be [H] or [1, H] with H = ", H, ", got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == hidden_dtype,
              "value_head: weight must be float32 or hidden's dtype ", hidden_dtype, ", got ", weight.scalar_type());
}

inline void check_value_head_args(const at::Tensor& hidden, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(hidden.dim() >= 1 && hidden.size(-1) >= 1, "value_head: hidden must be [..., H] with H >= 1, got ",
              hidden.sizes());
  check_value_head_weight(weight, hidden.size(-1), hidden.scalar_type());
  TORCH_CHECK(weight.device() == hidden.device(), "value_head: weight and hidden must be on one device");
  if (bias) {
    TORCH_CHECK(bias->dim() <= 1 && bias->numel() == 1, "value_head: bias must be a scalar or [1], got ",
                bias->sizes());
    TORCH_CHECK(bias->scalar_type() == at::kFloat || bias->scalar_type() == hidden.scalar_type(),
                "value_head: bias must be float32 or hidden's dtype, got ", bias->scalar_type());
    TORCH_CHECK(bias->device() == hidden.device(), "value_head: bias and hidden must be on one device");
  }
}

// The weight as a contiguous [H] vector in the accumulation type (no copy for a contiguous one).
inline at::Tensor value_head_weight(const at::Tensor& weight, at::ScalarType acc_type) {
  return weight.reshape({-1}).to(acc_type).contiguous();
}

// hidden's shape without its last dimension: the shape of the values and of their gradient.
inline std::vector<int64_t> value_head_out_shape(at::IntArrayRef hidden_shape) {
  return hidden_shape.slice(0, hidden_shape.size() - 1).vec();
}

inline void check_value_head_grad(const at::Tensor& grad_out, at::IntArrayRef hidden_shape,
                                  at::ScalarType hidden_dtype, const at::Tensor& other) {
  const auto values_shape = value_head_out_shape(hidden_shape);
  const at::ScalarType acc_type = acc_dtype(hidden_dtype);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(values_shape) && grad_out.scalar_type() == acc_type &&
                  grad_out.device() == other.device(),
              "value_head backward: grad_out must match the values' shape ", at::IntArrayRef(values_shape), ", dtype ",
              acc_type, " and device ", other.device(), ", got ", grad_out.sizes(), " ", grad_out.scalar_type(),
              " on ", grad_out.device());
}

// value_head_backward_hidden's arguments checked; returns the hidden gradient's shape (grad_out's
// with H appended).
inline std::vector<int64_t> backward_hidden_shape(const at::Tensor& grad_out, const at::Tensor& weight,
                                                  at::ScalarType hidden_dtype) {
  const int64_t H = weight.size(-1);
  check_value_head_weight(weight, H, hidden_dtype);
  auto shape = grad_out.sizes().vec();
  shape.push_back(H);
  check_value_head_grad(grad_out, shape, hidden_dtype, weight);
  return shape;
}

// value_head_backward_params's arguments checked.
inline void check_backward_params_args(const at::Tensor& grad_out, const at::Tensor& hidden) {
  TORCH_CHECK(hidden.dim() >= 1 && hidden.size(-1) >= 1,
              "value_head backward: hidden must be [..., H] with H >= 1, got ", hidden.sizes());
  check_value_head_grad(grad_out, hidden.sizes(), hidden.scalar_type(), hidden);
}

template <class Kernels>
at::Tensor forward(const at::Tensor& hidden_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  check_value_head_args(hidden_in, weight_in, bias_in);
  const at::DeviceGuard guard(hidden_in.device());
  const at::ScalarType acc_type = acc_dtype(hidden_in.scalar_type());
  const at::Tensor hidden = hidden_in.contiguous(), weight = value_head_weight(weight_in, acc_type);
  const at::Tensor bias = bias_in ? bias_in->to(acc_type).contiguous() : at::Tensor();
  at::Tensor out = at::empty(value_head_out_shape(hidden.sizes()), hidden.options().dtype(acc_type));
  Params p;
  p.rows = out.numel();
  p.H = hidden.size(-1);
  p.hidden = hidden.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.bias = bias.defined() ? bias.const_data_ptr() : nullptr;
  p.out = out.mutable_data_ptr();
  Kernels::forward(p, hidden);
  return out;
}

template <class Kernels>
at::Tensor backward_hidden(const at::Tensor& grad_out_in, const at::Tensor& weight_in, at::ScalarType hidden_dtype) {
  const auto hidden_shape = backward_hidden_shape(grad_out_in, weight_in, hidden_dtype);
  const at::DeviceGuard guard(grad_out_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous();
  const at::Tensor weight = value_head_weight(weight_in, acc_dtype(hidden_dtype));
  at::Tensor grad_hidden = at::empty(hidden_shape, grad_out.options().dtype(hidden_dtype));
  Params p;
  p.rows = grad_out.numel();
  p.H = hidden_shape.back();
  p.grad_out = grad_out.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.grad_hidden = grad_hidden.mutable_data_ptr();
  Kernels::backward_hidden(p, grad_hidden);
  return grad_hidden;
}

template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward_params(const at::Tensor& grad_out_in, const at::Tensor& hidden_in) {
  check_backward_params_args(grad_out_in, hidden_in);
  const at::DeviceGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), grad_out = grad_out_in.contiguous();
  Params p;
  p.rows = grad_out.numel();
  p.H = hidden.size(-1);
  const int64_t blocks = value_head_row_blocks(p.rows);
  const auto opts = grad_out.options();  // the accumulation dtype, checked above
  at::Tensor weight_partials = at::empty({blocks, p.H}, opts), bias_partials = at::empty({blocks}, opts);
  at::Tensor grad_weight = at::empty({p.H}, opts), grad_bias = at::empty({}, opts);
  p.grad_out = grad_out.const_data_ptr();
  p.hidden = hidden.const_data_ptr();
  p.weight_partials = weight_partials.mutable_data_ptr();
  p.bias_partials = bias_partials.mutable_data_ptr();
  p.grad_weight = grad_weight.mutable_data_ptr();
  p.grad_bias = grad_bias.mutable_data_ptr();
  Kernels::backward_params(p, hidden);
  return {grad_weight, grad_bias};
}

}  // namespace fused_rl_ops::value_head
