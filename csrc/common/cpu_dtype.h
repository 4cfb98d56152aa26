// The element types an op's CPU row kernels read and write in the op's input dtype (clamped_swiglu's
// x, value_head's hidden): DType's three and float64 (gradcheck), which only the CPU takes. The torch
// glue names the dtype (to_cpu_dtype, common/torch_utils.h); the torch-free row kernels run the
// matching instantiation.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace fused_rl_ops {

enum class CpuDType : int { kFloat64, kFloat32, kBFloat16, kFloat16 };

// fn(scalar_t{}) for the element type t names.
template <class Fn>
void with_cpu_dtype(CpuDType t, const Fn& fn) {
  switch (t) {
    case CpuDType::kFloat64: return fn(double{});
    case CpuDType::kFloat32: return fn(float{});
    case CpuDType::kBFloat16: return fn(c10::BFloat16{});
    case CpuDType::kFloat16: return fn(c10::Half{});
  }
}

}  // namespace fused_rl_ops
