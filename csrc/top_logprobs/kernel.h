// Torch-free launcher of top_logprobs' CUDA row kernel, with a Params (top_logprobs/params.h; fp32
// buffers). Returns the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include "top_logprobs/params.h"

namespace fused_rl_ops::top_logprobs {

// Reads logits once; merges the chunk into stats and gives it, with ids, to top and top_ids.
cudaError_t launch_top_logprobs_stats_top_ids_rows(const Params& p, cudaStream_t stream);

}  // namespace fused_rl_ops::top_logprobs
