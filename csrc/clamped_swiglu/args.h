// Argument checks and output allocation shared by the CPU and CUDA entry points of clamped_swiglu.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "clamped_swiglu/math.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::clamped_swiglu {

// One call's tensors, viewed as [rows, 2F] inputs and [rows, F] outputs (all contiguous).
struct CallTensors {
  at::Tensor x, half, full;  // x [rows, 2F]; half: y or dy [rows, F]; full: dx [rows, 2F] (backward)
  at::Tensor scale;          // the weighted form's per-row scale, [rows] in x's accumulation dtype; else undefined
  int64_t rows, F;
  Params p;
};

inline CallTensors call_tensors(const at::Tensor& x_in, std::optional<double> limit, double alpha,
                                double linear_offset) {
  TORCH_CHECK(x_in.dim() >= 1, "clamped_swiglu: x must have at least one dimension");
  TORCH_CHECK(x_in.size(-1) % 2 == 0, "clamped_swiglu: x's last dimension must be even, got ", x_in.size(-1));
  TORCH_CHECK(!limit.has_value() || *limit > 0, "clamped_swiglu: limit must be > 0 or None");
  CallTensors call;
  call.x = x_in.contiguous();
  call.F = x_in.size(-1) / 2;
  call.rows = call.F == 0 ? 0 : x_in.numel() / (2 * call.F);
  call.p = Params{static_cast<float>(alpha), static_cast<float>(limit.value_or(INFINITY)),
                        static_cast<float>(linear_offset)};
  return call;
}

// The weighted form's scale: x.shape[:-1] or x.shape[:-1] + (1,), float32 or x's dtype, on x's device;
// returned contiguous in x's accumulation dtype (a [rows] view; the widening is exact).
inline at::Tensor scale_rows(const at::Tensor& scale, const at::Tensor& x) {
  const auto lead = x.sizes().slice(0, x.dim() - 1);
  auto with_one = lead.vec();
  with_one.push_back(1);
  TORCH_CHECK(scale.sizes() == lead || scale.sizes() == at::IntArrayRef(with_one),
              "clamped_swiglu: scale must have shape x.shape[:-1] ", lead, " or x.shape[:-1] + (1,), got ",
              scale.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == x.scalar_type(),
              "clamped_swiglu: scale must be float32 or x's dtype (", x.scalar_type(), "), got ",
              scale.scalar_type());
  TORCH_CHECK(scale.device() == x.device(), "clamped_swiglu: scale must be on x's device (", x.device(), "), got ",
              scale.device());
  return scale.to(acc_dtype(x.scalar_type())).contiguous();
}

inline std::vector<int64_t> out_shape(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

// Forward: allocates y as `half`.
inline CallTensors forward_call(const at::Tensor& x, std::optional<double> limit, double alpha,
                                double linear_offset, const std::optional<at::Tensor>& scale) {
  CallTensors call = call_tensors(x, limit, alpha, linear_offset);
  if (scale.has_value()) call.scale = scale_rows(*scale, x);
  call.half = at::empty(out_shape(x), x.options());
  return call;
}

// Backward: checks grad_out against the output and allocates dx as `full`.
inline CallTensors backward_call(const at::Tensor& grad_out, const at::Tensor& x, std::optional<double> limit,
                                 double alpha, double linear_offset) {
  CallTensors call = call_tensors(x, limit, alpha, linear_offset);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape(x)) && grad_out.scalar_type() == x.scalar_type() &&
                  grad_out.device() == x.device(),
              "clamped_swiglu_backward: grad_out must match the output's shape, dtype and device");
  call.half = grad_out.contiguous();
  call.full = at::empty(call.x.sizes(), call.x.options());
  return call;
}

// Weighted backward: as backward_call, plus the scale; the scale's gradient is allocated by
// scale_grad_buffer.
inline CallTensors scaled_backward_call(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& scale,
                                        std::optional<double> limit, double alpha, double linear_offset) {
  CallTensors call = backward_call(grad_out, x, limit, alpha, linear_offset);
  call.scale = scale_rows(scale, x);
  return call;
}

// The [rows] gradient of the scale in the accumulation dtype: zeros when there is no element to sum.
inline at::Tensor scale_grad_buffer(const CallTensors& call) {
  return call.rows == 0 ? at::zeros_like(call.scale) : at::empty_like(call.scale);
}

// The scale gradient in the scale's own shape and dtype.
inline at::Tensor scale_grad(const at::Tensor& grad_rows, const at::Tensor& scale) {
  return grad_rows.view(scale.sizes()).to(scale.scalar_type());
}

}  // namespace fused_rl_ops::clamped_swiglu
