// One launch of the clamped SwiGLU kernels, CPU or CUDA: its buffers, sizes and constants. Free of
// torch and CUDA headers: filled by clamped_swiglu/entry.h and by the kernels-on-CPU driver.
#pragma once

#include "clamped_swiglu/math.h"

namespace fused_rl_ops::clamped_swiglu {

// x, y, dy and dx are contiguous in x's element type; scale and dscale are [rows] in its
// accumulation type (acc_t: fp32, fp64 for double on the CPU). A launch leaves the buffers it does
// not use null.
struct Params {
  const void* x = nullptr;      // [rows, 2F]: the halves [g | u], or (g, u) pairs with interleaved
  const void* scale = nullptr;  // the weighted form's per-row scales; null for the plain form
  const void* dy = nullptr;     // backward: the upstream gradient, [rows, F]
  void* y = nullptr;            // forward: the output, [rows, F]
  void* dx = nullptr;           // backward: x's gradient, [rows, 2F]
  void* dscale = nullptr;       // weighted backward: the scales' gradient, [rows]
  int64_t rows = 0, F = 0;
  bool interleaved = false;
  Activation act;
};

}  // namespace fused_rl_ops::clamped_swiglu
