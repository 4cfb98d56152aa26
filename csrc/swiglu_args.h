// Argument checks and output allocation shared by the CPU and CUDA entry points of clamped_swiglu.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "swiglu_math.h"
#include "torch_utils.h"

namespace fused_rl_ops {

// One call's tensors, viewed as [rows, 2F] inputs and [rows, F] outputs (all contiguous).
struct SwigluCall {
  at::Tensor x, half, full;  // x [rows, 2F]; half: y or dy [rows, F]; full: dx [rows, 2F] (backward)
  int64_t rows, F;
  SwigluParams p;
};

inline SwigluCall swiglu_call(const at::Tensor& x_in, std::optional<double> limit, double alpha, double linear_offset) {
  TORCH_CHECK(x_in.dim() >= 1, "clamped_swiglu: x must have at least one dimension");
  TORCH_CHECK(x_in.size(-1) % 2 == 0, "clamped_swiglu: x's last dimension must be even, got ", x_in.size(-1));
  TORCH_CHECK(!limit.has_value() || *limit > 0, "clamped_swiglu: limit must be > 0 or None");
  SwigluCall call;
  call.x = x_in.contiguous();
  call.F = x_in.size(-1) / 2;
  call.rows = call.F == 0 ? 0 : x_in.numel() / (2 * call.F);
  call.p = SwigluParams{static_cast<float>(alpha), static_cast<float>(limit.value_or(INFINITY)),
                        static_cast<float>(linear_offset)};
  return call;
}

inline std::vector<int64_t> swiglu_out_shape(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

// Forward: allocates y as `half`.
inline SwigluCall swiglu_forward_call(const at::Tensor& x, std::optional<double> limit, double alpha,
                                      double linear_offset) {
  SwigluCall call = swiglu_call(x, limit, alpha, linear_offset);
  call.half = empty_buffer(swiglu_out_shape(x), x.options());
  return call;
}

// Backward: checks grad_out against the output and allocates dx as `full`.
inline SwigluCall swiglu_backward_call(const at::Tensor& grad_out, const at::Tensor& x, std::optional<double> limit,
                                       double alpha, double linear_offset) {
  SwigluCall call = swiglu_call(x, limit, alpha, linear_offset);
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(swiglu_out_shape(x)) && grad_out.scalar_type() == x.scalar_type() &&
                  grad_out.device() == x.device(),
              "clamped_swiglu_backward: grad_out must match the output's shape, dtype and device");
  call.half = grad_out.contiguous();
  call.full = empty_buffer(call.x.sizes(), call.x.options());
  return call;
}

}  // namespace fused_rl_ops
