// The stats of no logits, as chosen_logprob's and top_logprobs's torch glue makes them (their row
// kernel: stats_rows_cpu.h on the CPU, stats_rows.cuh on CUDA).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "vocab_parallel/row_stats.h"

namespace fused_rl_ops {

// Stats of no logits (partial_empty), shape [..., stats_column::chosen + tokens_per_row].
inline at::Tensor empty_stats(at::IntArrayRef rows, int64_t tokens_per_row, const at::TensorOptions& options) {
  std::vector<int64_t> shape = rows.vec();
  shape.push_back(stats_column::chosen + tokens_per_row);
  at::Tensor stats = at::zeros(shape, options);
  stats.select(-1, stats_column::max).fill_(-INFINITY);
  return stats;
}

}  // namespace fused_rl_ops
