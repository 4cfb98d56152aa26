// One launch of top_logprobs' row kernels (stats and top ids: one CUDA kernel), CPU or CUDA: its buffers,
// sizes and logit map. Free of torch and CUDA headers: filled by top_logprobs/entry.h and by the
// kernels-on-CPU driver.
#pragma once

#include <cstdint>

#include "vocab_parallel/logit_map.h"

namespace fused_rl_ops::top_logprobs {

// Buffers contiguous in the accumulation type (fp32; fp64 for float64 inputs on the CPU) but ids.
struct Params {
  const void* logits = nullptr;  // [rows, cols] raw logits h . w of one pass against one vocab chunk
  void* stats = nullptr;         // stats_rows: [rows, stats_column::chosen], the chunk merged in
  // the top: [rows, top_width] values and int64 global ids of each row's top (top_ids.h).
  void* top = nullptr;
  int64_t* top_ids = nullptr;
  int64_t top_width = 0;
  int64_t rows = 0;
  int64_t cols = 0;  // the chunk's vocabulary rows
  int64_t col0 = 0;  // the global id of column 0
  LogitMap logit_map;
  // What the shared stats_rows kernel reads beside: top_logprobs scores no tokens and has no filter.
  const int64_t* tokens = nullptr;
  int64_t tokens_per_row = 0;
  const void* threshold = nullptr;
};

}  // namespace fused_rl_ops::top_logprobs
