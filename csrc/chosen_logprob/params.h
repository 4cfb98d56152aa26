// One launch of chosen_logprob's row kernels (stats_rows, grad_rows, combine), CPU or CUDA: its
// buffers, sizes and constants. Free of torch and CUDA headers: filled by chosen_logprob/chunks.h
// and chosen_logprob/entry.h, and by the kernels-on-CPU driver.
#pragma once

#include <cstdint>

namespace fused_rl_ops::chosen_logprob {

// Every buffer is contiguous in the accumulation type (fp32; fp64 for float64 inputs on the CPU)
// except tokens (int64 global ids). A launch leaves the buffers it does not use null.
struct Params {
  // stats_rows and grad_rows: one pass of token rows against one vocab chunk.
  void* logits = nullptr;           // [rows, cols] raw logits h . w; grad_rows overwrites them with their gradient
  const int64_t* tokens = nullptr;  // [rows]
  void* stats = nullptr;            // stats_rows: [rows, 4] (max, sum, ent, chosen), the chunk merged in
  // grad_rows, [rows] each: the global row max, lse and mean (= lse - entropy) relative to it, and
  // the upstream gradients of logprob and entropy.
  const void* row_max = nullptr;
  const void* lse = nullptr;
  const void* mean = nullptr;
  const void* grad_logprob = nullptr;
  const void* grad_entropy = nullptr;
  // combine: [ranks, rows, 4] per-shard stats -> [rows, 4] (row max, lse - row max, entropy, chosen).
  const void* partials = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;   // the chunk's vocabulary rows
  int64_t col0 = 0;   // the global id of column 0
  int64_t ranks = 0;  // combine: the shards
  double temperature = 1.0;
  double softcap = 0.0;  // 0: no cap
};

}  // namespace fused_rl_ops::chosen_logprob
