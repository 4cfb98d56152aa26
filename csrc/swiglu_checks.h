// Argument checks shared by the CPU and CUDA entry points of clamped_swiglu.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "swiglu_math.h"

namespace fused_rl_ops {

inline void check_swiglu_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "clamped_swiglu: x must have at least one dimension");
  TORCH_CHECK(x.size(-1) % 2 == 0, "clamped_swiglu: x's last dimension must be even, got ", x.size(-1));
}

inline SwigluParams swiglu_params(std::optional<double> limit, double alpha, double linear_offset) {
  TORCH_CHECK(!limit.has_value() || *limit > 0, "clamped_swiglu: limit must be > 0 or None");
  return SwigluParams{static_cast<float>(alpha), static_cast<float>(limit.value_or(INFINITY)),
                      static_cast<float>(linear_offset)};
}

inline std::vector<int64_t> swiglu_out_shape(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

}  // namespace fused_rl_ops
