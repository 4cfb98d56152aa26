// The clamped SwiGLU ops, one implementation for the CPU and CUDA kernels: argument checks, output
// allocation and the launch's Params. Kernels (cpu.cpp's, cuda.cpp's) runs a Params for x's dtype;
// each device file registers these templates with its own Kernels.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "clamped_swiglu/params.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::clamped_swiglu {

// Checks x and the scalars; returns Params with the sizes and constants of x viewed as [rows, 2F].
inline Params shape_params(const at::Tensor& x, std::optional<double> limit, double alpha, double linear_offset,
                           bool interleaved) {
  TORCH_CHECK(x.dim() >= 1, "clamped_swiglu: x must have at least one dimension");
  TORCH_CHECK(x.size(-1) % 2 == 0, "clamped_swiglu: x's last dimension must be even, got ", x.size(-1));
  TORCH_CHECK(!limit.has_value() || *limit > 0, "clamped_swiglu: limit must be > 0 or None");
  Params p;
  p.F = x.size(-1) / 2;
  p.rows = p.F == 0 ? 0 : x.numel() / (2 * p.F);
  p.interleaved = interleaved;
  p.act = Activation{static_cast<float>(alpha), static_cast<float>(limit.value_or(INFINITY)),
                     static_cast<float>(linear_offset)};
  return p;
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
  const at::Tensor x = x_in.contiguous(), scale = scale_in ? scale_rows(*scale_in, x_in) : at::Tensor();
  at::Tensor y = at::empty(out_shape(x_in), x.options());
  p.x = x.const_data_ptr();
  p.scale = scale.defined() ? scale.const_data_ptr() : nullptr;
  p.y = y.mutable_data_ptr();
  Kernels::forward(p, x);
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
  Kernels::backward(p, x);
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
  const at::Tensor x = x_in.contiguous(), dy = grad_out.contiguous(), scale = scale_rows(scale_in, x_in);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  // The kernels write every row's sum; with no element to sum there is nothing to launch.
  at::Tensor dscale = p.rows * p.F == 0 ? at::zeros_like(scale) : at::empty_like(scale);
  p.x = x.const_data_ptr();
  p.dy = dy.const_data_ptr();
  p.scale = scale.const_data_ptr();
  p.dx = dx.mutable_data_ptr();
  p.dscale = dscale.mutable_data_ptr();
  Kernels::scaled_backward(p, x);
  return {dx, dscale.view(scale_in.sizes()).to(scale_in.scalar_type())};
}

}  // namespace fused_rl_ops::clamped_swiglu
