// Torch-free launchers of the clamped SwiGLU CUDA kernels, one Params each (clamped_swiglu/params.h;
// the forward reads x and scale and writes y, the backwards read dy, x and scale and write dx and
// dscale) for elements of type dtype. Return the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "clamped_swiglu/params.h"

namespace fused_rl_ops::clamped_swiglu {

cudaError_t launch_clamped_swiglu_forward(const Params& p, DType dtype, cudaStream_t stream);
cudaError_t launch_clamped_swiglu_backward(const Params& p, DType dtype, cudaStream_t stream);
cudaError_t launch_clamped_swiglu_scaled_backward(const Params& p, DType dtype, cudaStream_t stream);

}  // namespace fused_rl_ops::clamped_swiglu
