// chosen_logprob's walks over the vocab chunks (vocab_parallel/chunk_loop.h, gradient_loop.h): the
// stats pass, a round of top_p's search, and the backward, each handing its rows to its row kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "chosen_logprob/math.h"
#include "chosen_logprob/params.h"
#include "chosen_logprob/sampler_filter.h"
#include "vocab_parallel/chunk_loop.h"
#include "vocab_parallel/gradient_loop.h"
#include "vocab_parallel/stats_rows.h"

namespace fused_rl_ops::chosen_logprob {

// The backward's per-position inputs, [N] each in the accumulation dtype: the global row max, the
// log-sum relative to it (lse - row_max) and the log-sum minus the entropy, and the upstream
// gradients of logprob ([N, k]: one per token) and entropy; and the thresholds of the sampler's
// filter (undefined: none).
struct TokenGrads {
  at::Tensor row_max, log_sum, log_sum_minus_entropy, grad_logprob, grad_entropy, threshold;
};

// The Params of a row kernel over on_chunk's rows of a chunk, with the rows' tokens [N, k].
inline Params row_params(const at::Tensor& logits, const ChunkStep& step, const at::Tensor& tokens,
                         const LogitMap& logit_map, const VocabShard& shard) {
  Params p = chunk_params<Params>(logits, step, logit_map, shard);
  p.tokens_per_row = tokens.size(1);
  p.tokens = step.rows_in<int64_t>(tokens);
  return p;
}

// The per-position partials (stats_column) of this shard's logits, over the valid rows of weight
// (valid_rows; all without it) and, with a threshold, the logits at or above it, with the chosen
// logits of tokens [N, k]. With a top width, followed by each row's top of those logits (width wide,
// chosen_logprob/sampler_filter.h).
template <class Kernels>
at::Tensor stats_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                      const std::optional<at::Tensor>& threshold, const LogitMap& logit_map, const VocabShard& shard,
                      const Tiling& tiling_options, int64_t width) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = shard.valid_rows.value_or(weight.size(0));
  at::Tensor stats = empty_stats({N}, tokens.size(1), hidden.options().dtype(acc));
  at::Tensor tops = width > 0 ? at::zeros({N, top_column::values + width}, stats.options()) : at::Tensor();
  const auto result = [&] { return width > 0 ? at::cat({stats, tops}, 1) : stats; };
  if (N == 0 || V == 0) return result();
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor tau = threshold ? threshold->contiguous() : at::Tensor();
  for_each_chunk<Kernels>(hidden, weight, V, tiling_options, [&](const at::Tensor& logits, const ChunkStep& step) {
    Params p = row_params(logits, step, tok, logit_map, shard);
    p.stats = step.rows_out(stats);
    if (tau.defined()) p.threshold = step.rows_in(tau);
    Kernels::stats_rows(p, acc);
    if (width > 0) {
      p.top = step.rows_out(tops);
      p.top_width = width;
      Kernels::top_rows(p, acc);
    }
  });
  return result();
}

// One round of the top_p search over this shard's logits (valid rows of weight): for each row with
// a window (window [N, 2] double, SearchWindow), the mass of its logits in the window's cells,
// relative to row_max, added to hist [N, kSearchBins] int64; with top, those logits given to
// it ([N, top_column::values + K]).
template <class Kernels>
void search_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& row_max,
                 const at::Tensor& window, at::Tensor& hist, const std::optional<at::Tensor>& top,
                 const LogitMap& logit_map, const VocabShard& shard, const Tiling& tiling_options) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = shard.valid_rows.value_or(weight.size(0));
  if (N == 0 || V == 0) return;
  const at::Tensor m = row_max.contiguous(), windows = window.contiguous();
  for_each_chunk<Kernels>(hidden, weight, V, tiling_options, [&](const at::Tensor& logits, const ChunkStep& step) {
    Params p = chunk_params<Params>(logits, step, logit_map, shard);
    p.row_max = step.rows_in(m);
    p.window = step.rows_in(windows);
    p.hist = step.rows_out(hist);
    Kernels::hist_rows(p, acc);
    if (top) {
      p.top = step.rows_out(*top);
      p.top_width = top->size(1) - top_column::values;
      Kernels::top_rows(p, acc);
    }
  });
}

// Gradients of sum(grad_logprob * logprob + grad_entropy * entropy) for this shard (gradient_loop,
// with the valid rows of the shard).
template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& tokens, const TokenGrads& token_grads,
                                                 const std::optional<at::Tensor>& main_grad, const LogitMap& logit_map,
                                                 const VocabShard& shard, const Tiling& tiling_options) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor row_max = token_grads.row_max.contiguous(), log_sum = token_grads.log_sum.contiguous();
  const at::Tensor log_sum_minus_entropy = token_grads.log_sum_minus_entropy.contiguous();
  const at::Tensor gl = token_grads.grad_logprob.contiguous(), ge = token_grads.grad_entropy.contiguous();
  const at::Tensor tau = token_grads.threshold.defined() ? token_grads.threshold.contiguous() : at::Tensor();
  // Several tokens per position: the rows' chosen-column gradients, taken before the logits are
  // overwritten (Params::entry_grads, CUDA; [pass, 1 + k], independent of the vocabulary).
  const int64_t k = tok.size(1), pass = RowTiling(hidden.size(0), tiling_options.row_block, tiling_options.pass_rows).pass;
  const at::Tensor entry_grads = k > 1 ? at::empty({pass * (1 + k)}, hidden.options().dtype(acc)) : at::Tensor();
  return gradient_loop<Kernels>(
      hidden, weight, shard.valid_rows.value_or(weight.size(0)), main_grad, tiling_options,
      [&](const at::Tensor& logits, const ChunkStep& step, const at::Tensor& d) {
        Params p = row_params(logits, step, tok, logit_map, shard);
        const auto row_ptr = [&](const at::Tensor& t) { return step.rows_in(t); };
        p.row_max = row_ptr(row_max);
        p.log_sum = row_ptr(log_sum);
        p.log_sum_minus_entropy = row_ptr(log_sum_minus_entropy);
        p.grad_logprob = row_ptr(gl);
        p.grad_entropy = row_ptr(ge);
        if (tau.defined()) p.threshold = row_ptr(tau);
        if (entry_grads.defined()) p.entry_grads = entry_grads.mutable_data_ptr();
        p.grads = d.data_ptr();
        p.grads_stride = d.stride(0);
        Kernels::grad_rows(p, acc, d.scalar_type());
      });
}

}  // namespace fused_rl_ops::chosen_logprob
