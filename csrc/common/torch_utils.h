// Helpers for the torch-side glue of the CPU and CUDA kernels (not for .cu files).
#pragma once

#include <ATen/ATen.h>

#include "common/math.h"

namespace fused_rl_ops {

// The accumulation (and fp32-output) dtype of a kernel reading `dtype`, as acc_t in common/math.h.
inline at::ScalarType acc_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

inline DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "fused_rl_ops: unsupported dtype ", t.scalar_type(), " on CUDA");
  }
}

}  // namespace fused_rl_ops
