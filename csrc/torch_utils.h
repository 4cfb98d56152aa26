// Helpers for the torch-side glue (not for .cu files).
#pragma once

#include <ATen/ATen.h>

#include "common.h"

namespace fused_rl_ops {

inline DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "fused_rl_ops: unsupported dtype ", t.scalar_type(), " on CUDA");
  }
}

}  // namespace fused_rl_ops
