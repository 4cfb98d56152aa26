// One launch of vocab_divergence's row kernels (stats_rows, mixture_rows, grad_rows, combine), CPU
// or CUDA: its buffers, sizes and the two logit maps. Free of torch and CUDA headers: filled by
// vocab_divergence/vocab_passes.h and vocab_divergence/entry.h, and by the kernels-on-CPU driver.
#pragma once

#include <cstdint>

#include "vocab_parallel/logit_map.h"

namespace fused_rl_ops::vocab_divergence {

// Every buffer is contiguous in the accumulation type (fp32; fp64 for float64 inputs on the CPU)
// but grads. A launch leaves the buffers it does not use null. Column layouts: vocab_divergence/math.h.
struct Params {
  // stats_rows, mixture_rows and grad_rows: one pass of token rows against one vocab chunk, the raw
  // logits of both models, [rows, cols] each.
  const void* logits = nullptr;
  const void* teacher_logits = nullptr;
  void* stats = nullptr;        // stats_rows: [rows, stats_column::count], the chunk merged in
  const void* row = nullptr;    // mixture_rows, grad_rows: [rows, combined_column::count], merged
  void* mixture = nullptr;      // mixture_rows: [rows, mixture_column::count], the chunk added
  // grad_rows: [rows] the divergence's row term (reverse_kl: the divergence; jsd: KL(student || M);
  // forward_kl: unused) and the upstream gradient.
  const void* row_term = nullptr;
  const void* grad = nullptr;
  // grad_rows: where the student's logit gradients go, [rows, cols] with rows grads_stride elements
  // apart, in the dtype the gradient GEMMs take (the CPU kernels: the accumulation type; the CUDA
  // launcher is told it). logits itself (grads_stride = cols) when that is the accumulation type.
  void* grads = nullptr;
  int64_t grads_stride = 0;
  // combine: [ranks, rows, stats_column::count] per-shard stats -> [rows, combined_column::count].
  const void* partials = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ranks = 0;
  LogitMap logit_map;          // the student's
  LogitMap teacher_logit_map;  // the teacher's (FRL_TEACHER_LOGIT_MAP)
  int kind = 0;                // Kind
  double beta = 0.5;           // jsd's weight of the teacher in M
};

}  // namespace fused_rl_ops::vocab_divergence
