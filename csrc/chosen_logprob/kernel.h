// Torch-free launchers of the chosen_logprob CUDA row kernels (math in chosen_logprob/math.h), one
// Params each (chosen_logprob/params.h; fp32 buffers, grads in the dtype given). The kernels map
// the raw logits with Params::logit_map (with_logit_map, vocab_parallel/logit_map.h), one kernel per map.
// Return the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "chosen_logprob/params.h"
#include "common/math.h"

namespace fused_rl_ops::chosen_logprob {

// Reads logits and tokens; merges the chunk into stats.
cudaError_t launch_chosen_logprob_stats_rows(const Params& p, cudaStream_t stream);
// logits -> d(grad_logprob * logprob + grad_entropy * entropy) / d(logits), into grads in grads_dtype
// (fp32 grads may be logits itself); with tokens_per_row > 1 through entry_grads.
cudaError_t launch_chosen_logprob_grad_rows(const Params& p, DType grads_dtype, cudaStream_t stream);
// Reads partials; writes out.
cudaError_t launch_chosen_logprob_combine(const Params& p, cudaStream_t stream);
// The sampler's filter (chosen_logprob/sampler_filter.h). Reads logits, threshold and window; gives
// the chunk to top.
cudaError_t launch_chosen_logprob_top_rows(const Params& p, cudaStream_t stream);
// Reads logits, row_max and window; adds the chunk to hist.
cudaError_t launch_chosen_logprob_hist_rows(const Params& p, cudaStream_t stream);

}  // namespace fused_rl_ops::chosen_logprob
