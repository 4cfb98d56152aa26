// Torch-free launchers of the vocab_divergence CUDA row kernels (math in vocab_divergence/math.h),
// one Params each (vocab_divergence/params.h; fp32 buffers, grads in the dtype given). The kernels
// map the raw logits with the two logit maps (with_logit_map, vocab_parallel/logit_map.h), one kernel per
// pair of maps (and per kind for grad_rows). Return the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "common/math.h"
#include "vocab_divergence/params.h"

namespace fused_rl_ops::vocab_divergence {

// Reads both models' logits; merges the chunk into stats.
cudaError_t launch_vocab_divergence_stats_rows(const Params& p, cudaStream_t stream);
// Reads both models' logits and the merged rows; adds the chunk's jsd sums to mixture.
cudaError_t launch_vocab_divergence_mixture_rows(const Params& p, cudaStream_t stream);
// The student's logits -> grad * d(divergence) / d(logits), into grads in grads_dtype (fp32 grads
// may be logits itself).
cudaError_t launch_vocab_divergence_grad_rows(const Params& p, DType grads_dtype, cudaStream_t stream);
// Reads partials; writes out.
cudaError_t launch_vocab_divergence_combine(const Params& p, cudaStream_t stream);

}  // namespace fused_rl_ops::vocab_divergence
