// The GEMMs of the vocab-chunk loop on the CPU (chosen_logprob/chunks.h lists what a device's
// Kernels supply): ATen GEMMs in the accumulation dtype (fp32, or fp64 for float64 inputs). An op's
// CpuKernels derive from it and add their row kernels.
#pragma once

#include <ATen/ATen.h>

#include "common/torch_utils.h"

namespace fused_rl_ops {

struct CpuGemms {
  static bool capturing() { return false; }  // no graphs on the CPU

  static at::Tensor gemm_operand(const at::Tensor& t, at::ScalarType acc) { return t.to(acc).contiguous(); }

  static void logits(const at::Tensor& h, const at::Tensor& w, at::Tensor& out) { at::mm_out(out, h, w.t()); }

  // The GEMMs take the logit gradients in the accumulation dtype.
  static at::ScalarType grad_dtype(at::ScalarType dtype) { return acc_dtype(dtype); }

  static void add_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) { out.addmm_(a, b); }

  static void mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    if (out.scalar_type() == a.scalar_type()) at::mm_out(out, a, b);
    else out.copy_(at::mm(a, b));
  }
};

}  // namespace fused_rl_ops
