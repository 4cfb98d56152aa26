// Torch-free launchers of top_logprobs' CUDA row kernels, one Params each (top_logprobs/params.h;
// fp32 buffers). Return the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "top_logprobs/params.h"

namespace fused_rl_ops::top_logprobs {

// Reads logits; merges the chunk into stats (the shared softmax-stats kernel, no tokens).
cudaError_t launch_top_logprobs_stats_rows(const Params& p, cudaStream_t stream);
// Reads logits; gives the chunk, with ids, to top and top_ids.
cudaError_t launch_top_logprobs_top_ids_rows(const Params& p, cudaStream_t stream);

}  // namespace fused_rl_ops::top_logprobs
