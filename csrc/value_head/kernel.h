// Torch-free launchers of the value-head CUDA kernels (math in value_head/math.h), one Params each
// (value_head/params.h; fp32 accumulation buffers) for hidden elements of type dtype. Return the
// launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "value_head/params.h"

namespace fused_rl_ops::value_head {

// Reads hidden, weight and bias; writes out.
cudaError_t launch_value_head_forward(const Params& p, DType dtype, cudaStream_t stream);
// Reads grad_out and weight; writes grad_hidden.
cudaError_t launch_value_head_backward_hidden(const Params& p, DType dtype, cudaStream_t stream);
// Reads grad_out and hidden; writes the partials, then grad_weight and grad_bias.
cudaError_t launch_value_head_backward_params(const Params& p, DType dtype, cudaStream_t stream);

}  // namespace fused_rl_ops::value_head
