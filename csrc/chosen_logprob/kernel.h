// Torch-free launchers of the chosen_logprob CUDA row kernels. logits is [N, C] row-major fp32 raw
// logits h . w, tokens int64 global ids, col0 the global id of column 0; stats [N, 4] (max, sum, ent,
// chosen). The softmax takes z = x / temperature, or with softcap > 0 z = softcap tanh(x / softcap) /
// temperature (softcap 0: none, a kernel without tanh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_rl_ops::chosen_logprob {

cudaError_t launch_chosen_logprob_stats_rows(const float* logits, int64_t N, int64_t C, int64_t col0,
                                             const int64_t* tokens, double temperature, double softcap, float* stats,
                                             cudaStream_t stream);
// In place: logits -> d(gl * logprob + ge * entropy) / d(logits); per token row_max, and lse and
// mean relative to it.
cudaError_t launch_chosen_logprob_grad_rows(float* logits, int64_t N, int64_t C, int64_t col0, const int64_t* tokens,
                                            const float* row_max, const float* lse, const float* mean,
                                            const float* gl, const float* ge, double temperature, double softcap,
                                            cudaStream_t stream);
// partials [ranks, N, 4] -> out [N, 4] (row max, lse - row max, entropy, chosen logit).
cudaError_t launch_chosen_logprob_combine(const float* partials, int64_t ranks, int64_t N, float* out,
                                          cudaStream_t stream);

}  // namespace fused_rl_ops::chosen_logprob
