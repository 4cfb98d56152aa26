// Torch-free launchers of the value-head CUDA kernels (math in value_head/math.h). hidden and
// grad_hidden are [rows, H] contiguous in dtype; weight is [H] fp32, bias one fp32 value or null;
// out and grad_out are [rows] fp32. Return the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "value_head/math.h"

namespace fused_rl_ops::value_head {

cudaError_t launch_value_head_forward(const void* hidden, const float* weight, const float* bias, float* out,
                                      int64_t rows, int64_t H, DType dtype, cudaStream_t stream);
cudaError_t launch_value_head_backward_hidden(const float* grad_out, const float* weight, void* grad_hidden,
                                              int64_t rows, int64_t H, DType dtype, cudaStream_t stream);
// weight_partials ([value_head_row_blocks(rows), H]) and bias_partials ([value_head_row_blocks(rows)])
// are fp32 scratch; grad_weight is [H] and grad_bias one value, both fp32.
cudaError_t launch_value_head_backward_params(const float* grad_out, const void* hidden, float* weight_partials,
                                              float* bias_partials, float* grad_weight, float* grad_bias,
                                              int64_t rows, int64_t H, DType dtype, cudaStream_t stream);

}  // namespace fused_rl_ops::value_head
