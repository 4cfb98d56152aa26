// One launch of chosen_logprob's row kernels (stats_rows, grad_rows, combine, and for the sampler's
// filter top_rows and hist_rows), CPU or CUDA: its buffers, sizes and logit map. Free of
// torch and CUDA headers: filled by chosen_logprob/vocab_passes.h and chosen_logprob/entry.h, and by the
// kernels-on-CPU driver.
#pragma once

#include <cstdint>

#include "vocab_parallel/logit_map.h"

namespace fused_rl_ops::chosen_logprob {

// Every buffer is contiguous in the accumulation type (fp32; fp64 for float64 inputs on the CPU)
// except tokens (int64 global ids), grads, window (double) and hist (int64). A launch leaves the
// buffers it does not use null. Stats rows have stats_column::count columns (chosen_logprob/math.h).
struct Params {
  // stats_rows and grad_rows: one pass of token rows against one vocab chunk.
  const void* logits = nullptr;     // [rows, cols] raw logits h . w
  // [rows, tokens_per_row]: k tokens per position (chosen_logprob/math.h); stats_rows may take
  // k = 0 (null tokens: no chosen logits).
  const int64_t* tokens = nullptr;
  int64_t tokens_per_row = 1;
  void* stats = nullptr;  // stats_rows: [rows, stats_column::chosen + tokens_per_row], the chunk merged in
  // grad_rows: where the logit gradients go, [rows, cols] with rows grads_stride elements apart, in
  // the dtype the gradient GEMMs take (the CPU kernels: the accumulation type; the CUDA launcher
  // is told it). logits itself (grads_stride = cols) when that is the accumulation type: each
  // element is then read and overwritten by one thread.
  void* grads = nullptr;
  int64_t grads_stride = 0;
  // grad_rows, [rows] each: the global row max, the log-sum relative to it (lse - row max) and the
  // log-sum minus the entropy, and the upstream gradients of logprob and entropy.
  const void* row_max = nullptr;  // and hist_rows
  const void* log_sum = nullptr;
  const void* log_sum_minus_entropy = nullptr;
  const void* grad_logprob = nullptr;  // [rows, tokens_per_row]
  const void* grad_entropy = nullptr;
  // grad_rows with tokens_per_row > 1 on CUDA: [rows * (1 + tokens_per_row)] accumulation-type
  // scratch, the rows' summed logprob gradients then their chosen columns' gradients
  // (gather_chosen_grads), written before the logits are overwritten.
  void* entry_grads = nullptr;
  // stats_rows, grad_rows and top_rows: [rows] the tokens' thresholds of the sampler's filter, the
  // logits below them dropped (chosen_logprob/sampler_filter.h); null: none dropped.
  const void* threshold = nullptr;
  // top_rows: [rows, top_column::values + top_width] the rows' tops, the chunk given to them.
  void* top = nullptr;
  int64_t top_width = 0;
  // hist_rows: [rows, kSearchBins] int64 search histograms, the chunk's mass added (relative to
  // row_max, the global row max); hist_rows and top_rows: [rows, 2] double search windows
  // (SearchWindow: sigma, hi), null for top_rows: every logit.
  void* hist = nullptr;
  const void* window = nullptr;
  // combine: [ranks, rows, stats_column::chosen + tokens_per_row] per-shard stats -> [rows, same]
  // (combined_column).
  const void* partials = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;   // the chunk's vocabulary rows
  int64_t col0 = 0;   // the global id of column 0
  int64_t ranks = 0;  // combine: the shards
  LogitMap logit_map;  // stats_rows, grad_rows, top_rows and hist_rows: the logits' map (with_logit_map)
};

}  // namespace fused_rl_ops::chosen_logprob
