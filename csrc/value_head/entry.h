// The value-head ops, written once over a device's Kernels, which each device file registers: the
// checks of the op's contract (in the words of the Python checks; the op has no options), output
// allocation and the launch's Params.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "common/torch_utils.h"
#include "value_head/params.h"

namespace fused_rl_ops::value_head {

constexpr const char* kOp = "value_head";

inline void check_hidden(const at::Tensor& hidden) {
  TORCH_CHECK_VALUE(hidden.dim() >= 1 && hidden.size(-1) >= 1, kOp, ": hidden must be [..., H] with H >= 1, got shape ",
                    hidden.sizes());
}

// The value_head op's arguments: hidden [..., H] in a floating dtype; weight [H] or [1, H] and bias
// (one value: a scalar or [1]) in float32 or hidden's dtype; all on one device.
inline void check_forward(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_float_dtype(kOp, "hidden", hidden);
  check_hidden(hidden);
  const int64_t H = hidden.size(-1);
  const bool weight_shape_ok = weight.sizes() == at::IntArrayRef({H}) || weight.sizes() == at::IntArrayRef({1, H});
  TORCH_CHECK_VALUE(weight_shape_ok, kOp,
                    ": weight must be [H] or [1, H] (H = hidden's last dimension), got shape ", weight.sizes(),
                    " for H = ", H);
  const auto check_dtype = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == hidden.scalar_type(), kOp, ": ", name,
                     " must be float32 or hidden's dtype, got ", t.scalar_type(), " (hidden: ", hidden.scalar_type(),
                     ")");
  };
  check_dtype("weight", weight);
  if (bias) check_dtype("bias", *bias);
  TORCH_CHECK_VALUE(!bias || (bias->dim() <= 1 && bias->numel() == 1), kOp,
                    ": bias must be a scalar tensor or [1], got shape ", bias->sizes());
  TORCH_CHECK_VALUE(weight.device() == hidden.device() && (!bias || bias->device() == hidden.device()), kOp,
                    ": all tensors must be on one device, got hidden on ", hidden.device(), ", weight on ",
                    weight.device(), bias ? c10::str(", bias on ", bias->device()) : std::string());
}

// The weight's H values as a contiguous [H] vector in the accumulation type (no copy for a
// contiguous one of that type); `other` is a tensor of the call, whose device the weight must share.
inline at::Tensor value_head_weight(const at::Tensor& weight, int64_t H, at::ScalarType acc_type,
                                    const at::Tensor& other) {
  TORCH_CHECK_VALUE(H >= 1 && weight.numel() == H && weight.device() == other.device(), kOp,
                    ": weight must be H >= 1 values (hidden's last dimension), on hidden's device");
  return weight.reshape({-1}).to(acc_type).contiguous();
}

// hidden's shape without its last dimension: the shape of the values and of their gradient.
inline std::vector<int64_t> value_head_out_shape(at::IntArrayRef hidden_shape) {
  return hidden_shape.slice(0, hidden_shape.size() - 1).vec();
}

// shape_ok: grad_out has the values' shape (the hidden gradient takes grad_out's, so any is).
inline void check_grad_out(bool shape_ok, const at::Tensor& grad_out, at::ScalarType acc_type,
                           const at::Tensor& other) {
  TORCH_CHECK_VALUE(shape_ok && grad_out.scalar_type() == acc_type && grad_out.device() == other.device(), kOp,
                    " backward: grad_out must match the values' shape, dtype and device");
}

template <class Kernels>
at::Tensor forward(const at::Tensor& hidden_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  check_forward(hidden_in, weight_in, bias_in);
  const at::DeviceGuard guard(hidden_in.device());
  const at::ScalarType acc_type = acc_dtype(hidden_in.scalar_type());
  const at::Tensor hidden = hidden_in.contiguous();
  const at::Tensor weight = value_head_weight(weight_in, hidden.size(-1), acc_type, hidden);
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
  const int64_t H = weight_in.numel();
  const at::ScalarType acc_type = acc_dtype(hidden_dtype);
  check_grad_out(/*shape_ok=*/true, grad_out_in, acc_type, weight_in);
  const at::DeviceGuard guard(grad_out_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), weight = value_head_weight(weight_in, H, acc_type, grad_out);
  auto hidden_shape = grad_out.sizes().vec();
  hidden_shape.push_back(H);
  at::Tensor grad_hidden = at::empty(hidden_shape, grad_out.options().dtype(hidden_dtype));
  Params p;
  p.rows = grad_out.numel();
  p.H = H;
  p.grad_out = grad_out.const_data_ptr();
  p.weight = weight.const_data_ptr();
  p.grad_hidden = grad_hidden.mutable_data_ptr();
  Kernels::backward_hidden(p, grad_hidden);
  return grad_hidden;
}

template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward_params(const at::Tensor& grad_out_in, const at::Tensor& hidden_in) {
  check_hidden(hidden_in);
  check_grad_out(grad_out_in.sizes() == at::IntArrayRef(value_head_out_shape(hidden_in.sizes())), grad_out_in,
                 acc_dtype(hidden_in.scalar_type()), hidden_in);
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
