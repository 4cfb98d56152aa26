// Torch-free launchers of the clamped SwiGLU CUDA kernels. x is [rows, 2F] contiguous, y and dy
// [rows, F] contiguous; p.limit = +inf means no clamp; scale (the weighted form) and dscale are
// [rows] fp32, scale null for the plain form. Return the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "clamped_swiglu/math.h"

namespace fused_rl_ops::clamped_swiglu {

cudaError_t launch_clamped_swiglu_forward(const void* x, const float* scale, void* y, int64_t rows, int64_t F,
                                          DType dtype, bool interleaved, Params p, cudaStream_t stream);
cudaError_t launch_clamped_swiglu_backward(const void* dy, const void* x, void* dx, int64_t rows, int64_t F,
                                           DType dtype, bool interleaved, Params p, cudaStream_t stream);
cudaError_t launch_clamped_swiglu_scaled_backward(const void* dy, const void* x, const float* scale, void* dx,
                                                  float* dscale, int64_t rows, int64_t F, DType dtype,
                                                  bool interleaved, Params p, cudaStream_t stream);

}  // namespace fused_rl_ops::clamped_swiglu
