// The clamped SwiGLU ops, written once over a device's Kernels, which each device file registers:
// the checks of the op's contract (the options as declared, and x and scale as the kernels read
// them, in the words of the Python checks), output allocation and the launch's Params.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "clamped_swiglu/params.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::clamped_swiglu {

constexpr const char* kOp = "clamped_swiglu";

// Checks x and the options; returns Params with the sizes and constants of x viewed as [rows, 2F].
inline Params shape_params(const at::Tensor& x, const Options& options) {
  check_options(kOp, options);
  check_float_dtype(kOp, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, kOp,
                    ": x's last dimension must be even (gate and linear halves), got shape ", x.sizes());
  Params p;
  p.F = x.size(-1) / 2;
  p.rows = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  p.interleaved = options.interleaved;
  p.act = activation(options);
  return p;
}

// The weighted form's scale, one value per row of x (shape x.shape[:-1], or that and 1), as a
// contiguous [rows] tensor in x's accumulation dtype (the widening is exact).
inline at::Tensor scale_rows(const at::Tensor& scale, const at::Tensor& x) {
  const at::IntArrayRef lead = x.sizes().slice(0, x.dim() - 1), shape = scale.sizes();
  TORCH_CHECK_VALUE(shape == lead || (shape.size() == lead.size() + 1 && shape.slice(0, lead.size()) == lead &&
                                      shape.back() == 1),
                    kOp, ": scale must have shape x.shape[:-1] or x.shape[:-1] + (1,), got ", shape,
                    " for x of shape ", x.sizes());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat || scale.scalar_type() == x.scalar_type(), kOp,
                   ": scale must be float32 or x's dtype, got ", scale.scalar_type(), " (x: ", x.scalar_type(), ")");
  TORCH_CHECK_VALUE(scale.device() == x.device(), kOp, ": all tensors must be on one device, got x on ", x.device(),
                    ", scale on ", scale.device());
  return scale.to(acc_dtype(x.scalar_type())).contiguous();
}

inline std::vector<int64_t> out_shape(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

inline void check_grad_out(const at::Tensor& grad_out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(out_shape(x)) && grad_out.scalar_type() == x.scalar_type() &&
                        grad_out.device() == x.device(),
                    kOp, "_backward: grad_out must match the output's shape, dtype and device");
}

template <class Kernels>
at::Tensor forward(const at::Tensor& x_in FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_PARAM),
                   const std::optional<at::Tensor>& scale_in) {
  Params p = shape_params(x_in, Options{FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_VALUE)});
  const at::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), scale = scale_in ? scale_rows(*scale_in, x_in) : at::Tensor();
  at::Tensor y = at::empty(out_shape(x_in), x.options());
  p.x = x.const_data_ptr();
  p.scale = scale.defined() ? scale.const_data_ptr() : nullptr;
  p.y = y.mutable_data_ptr();
  if (p.rows * p.F > 0) Kernels::forward(p, x);
  return y;
}

template <class Kernels>
at::Tensor backward(const at::Tensor& grad_out, const at::Tensor& x_in FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_PARAM)) {
  Params p = shape_params(x_in, Options{FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_VALUE)});
  check_grad_out(grad_out, x_in);
  const at::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = grad_out.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  p.x = x.const_data_ptr();
  p.dy = dy.const_data_ptr();
  p.dx = dx.mutable_data_ptr();
  if (p.rows * p.F > 0) Kernels::backward(p, x);
  return dx;
}

// The weighted form's backward: x's gradient and the scale's, in the scale's shape and dtype.
template <class Kernels>
std::tuple<at::Tensor, at::Tensor> scaled_backward(const at::Tensor& grad_out, const at::Tensor& x_in,
                                                   const at::Tensor& scale_in
                                                       FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_PARAM)) {
  Params p = shape_params(x_in, Options{FRL_CLAMPED_SWIGLU_OPTIONS(FRL_OPTION_VALUE)});
  check_grad_out(grad_out, x_in);
  const at::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = grad_out.contiguous(), scale = scale_rows(scale_in, x_in);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  // The kernels write every row's sum; with no element to sum they do not run.
  at::Tensor dscale = p.rows * p.F == 0 ? at::zeros_like(scale) : at::empty_like(scale);
  p.x = x.const_data_ptr();
  p.dy = dy.const_data_ptr();
  p.scale = scale.const_data_ptr();
  p.dx = dx.mutable_data_ptr();
  p.dscale = dscale.mutable_data_ptr();
  if (p.rows * p.F > 0) Kernels::scaled_backward(p, x);
  return {dx, dscale.view(scale_in.sizes()).to(scale_in.scalar_type())};
}

}  // namespace fused_rl_ops::clamped_swiglu
