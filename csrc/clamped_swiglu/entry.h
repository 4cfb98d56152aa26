// The clamped SwiGLU ops, one implementation for the CPU and CUDA kernels: output allocation and the
// launch's Params. Kernels (cpu.cpp's, cuda.cpp's) runs a Params for x's dtype; each device file
// registers these templates with its own Kernels. The user-facing argument checks are
// fused_rl_ops/clamped_swiglu.py's; these check only what the kernels' memory accesses rely on.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "clamped_swiglu/params.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::clamped_swiglu {

// Checks x; returns Params with the sizes and constants of x viewed as [rows, 2F].
inline Params shape_params(const at::Tensor& x, std::optional<double> limit, double alpha, double linear_offset,
                           bool interleaved) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "clamped_swiglu: x must be [..., 2F]");
  Params p;
  p.F = x.size(-1) / 2;
  p.rows = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  p.interleaved = interleaved;
  p.act = Activation{static_cast<float>(alpha), static_cast<float>(limit.value_or(INFINITY)),
                     static_cast<float>(linear_offset)};
  return p;
}

// The weighted form's scale, one value per row of x, as a contiguous [rows] tensor in x's accumulation
// dtype (the widening is exact).
inline at::Tensor scale_rows(const at::Tensor& scale, const at::Tensor& x, const Params& p) {
  TORCH_CHECK(scale.numel() == p.rows && scale.device() == x.device(),
              "clamped_swiglu: scale must have shape x.shape[:-1], on x's device");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == x.scalar_type(),
              "clamped_swiglu: scale must be float32 or x's dtype");
  return scale.to(acc_dtype(x.scalar_type())).contiguous();
}

inline std::vector<int64_t> out_shape(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

inline void check_grad_out(const at::Tensor& grad_out, const at::Tensor& x) {
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape(x)) && grad_out.scalar_type() == x.scalar_type() &&
                  grad_out.device() == x.device(),
              "clamped_swiglu_backward: grad_out must match the output's shape, dtype and device");
}

template <class Kernels>
at::Tensor forward(const at::Tensor& x_in, std::optional<double> limit, double alpha, double linear_offset,
                   bool interleaved, const std::optional<at::Tensor>& scale_in) {
  Params p = shape_params(x_in, limit, alpha, linear_offset, interleaved);
  const at::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), scale = scale_in ? scale_rows(*scale_in, x_in, p) : at::Tensor();
  at::Tensor y = at::empty(out_shape(x_in), x.options());
  p.x = x.const_data_ptr();
  p.scale = scale.defined() ? scale.const_data_ptr() : nullptr;
  p.y = y.mutable_data_ptr();
  if (p.rows * p.F > 0) Kernels::forward(p, x);
  return y;
}

template <class Kernels>
at::Tensor backward(const at::Tensor& grad_out, const at::Tensor& x_in, std::optional<double> limit, double alpha,
                    double linear_offset, bool interleaved) {
  Params p = shape_params(x_in, limit, alpha, linear_offset, interleaved);
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
                                                   const at::Tensor& scale_in, std::optional<double> limit,
                                                   double alpha, double linear_offset, bool interleaved) {
  Params p = shape_params(x_in, limit, alpha, linear_offset, interleaved);
  check_grad_out(grad_out, x_in);
  const at::DeviceGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = grad_out.contiguous(), scale = scale_rows(scale_in, x_in, p);
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
