// One launch of the value-head kernels, CPU or CUDA: its buffers and sizes. Free of torch and CUDA
// headers: filled by value_head/entry.h and by the kernels-on-CPU driver.
#pragma once

#include "value_head/math.h"

namespace fused_rl_ops::value_head {

// hidden and grad_hidden are [rows, H] contiguous in hidden's element type; every other buffer is
// contiguous in its accumulation type (acc_t: fp32, fp64 for double on the CPU). A launch leaves the
// buffers it does not use null.
struct Params {
  const void* hidden = nullptr;    // [rows, H]
  const void* weight = nullptr;    // [H]
  const void* bias = nullptr;      // forward: one value, or null for no bias
  const void* grad_out = nullptr;  // backward: the values' gradient, [rows]
  void* out = nullptr;             // forward: the values, [rows]
  void* grad_hidden = nullptr;     // backward_hidden: [rows, H]
  // backward_params: stage 1's scratch, [value_head_row_blocks(rows), H] and [value_head_row_blocks(rows)]
  void* weight_partials = nullptr;
  void* bias_partials = nullptr;
  void* grad_weight = nullptr;  // backward_params: [H]
  void* grad_bias = nullptr;    // backward_params: one value
  int64_t rows = 0, H = 0;
};

}  // namespace fused_rl_ops::value_head
