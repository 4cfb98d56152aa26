// chosen_logprob's ops, written once over a device's Kernels, which each device file registers.
// Each checks its contract first (its option groups, and what its kernels rely on, in the words of
// the Python checks), leaves out the rows it need not compute (RowSkipping), then walks the chunks.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "chosen_logprob/vocab_passes.h"
#include "chosen_logprob/options.h"
#include "vocab_parallel/checks.h"
#include "vocab_parallel/combine.h"
#include "vocab_parallel/row_skipping.h"
#include "vocab_parallel/stats_rows.h"

namespace fused_rl_ops::chosen_logprob {

constexpr const char* kOp = "chosen_logprob";

// An optional per-token tensor t (threshold): [N] in the accumulation dtype on hidden's device.
inline void check_per_token(const char* what, const std::optional<at::Tensor>& t, const at::Tensor& hidden) {
  TORCH_CHECK_VALUE(!t || (t->dim() == 1 && t->size(0) == hidden.size(0) &&
                           t->scalar_type() == acc_dtype(hidden.scalar_type()) && t->device() == hidden.device()),
                    kOp, ": ", what, " must be [N] in the accumulation dtype, on hidden's device");
}

// The stats and backward ops' inputs: check_shard_inputs with their tokens, then their own options and the
// sampler's threshold.
inline void check_scoring_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                                 const VocabParallelOptions& groups, const Options& options,
                                 const std::optional<at::Tensor>& threshold) {
  check_shard_inputs(kOp, hidden, weight, &tokens, groups);
  check_options(kOp, options);
  check_per_token("threshold", threshold, hidden);
}

// The rows whose tokens [N, k] all equal ignore_index (none without one) as an op leaves them out.
template <class Kernels>
RowSkipping skipping_ignored(const at::Tensor& tokens, std::optional<int64_t> ignore_index) {
  return ignore_index ? RowSkipping::of<Kernels>((tokens == *ignore_index).all(1)) : RowSkipping{};
}

// tokens [N] as [N, 1]; [N, k] as they are.
inline at::Tensor per_row(const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(1) : t; }

template <class Kernels>
at::Tensor stats(const at::Tensor& hidden, const at::Tensor& weight,
                 const at::Tensor& tokens FRL_CHOSEN_LOGPROB_OP_OPTIONS(FRL_OPTION_PARAM),
                 const std::optional<at::Tensor>& threshold) {
  const VocabParallelOptions groups{FRL_VOCAB_PARALLEL_VALUES};
  check_scoring_inputs(hidden, weight, tokens, groups, Options{FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VALUE)},
                       threshold);
  const at::DeviceGuard guard(hidden.device());
  const at::Tensor tokens_2d = per_row(tokens);
  const RowSkipping skipping = skipping_ignored<Kernels>(tokens_2d, ignore_index);
  const std::optional<at::Tensor> tau = threshold ? std::optional(skipping.rows(*threshold, 0)) : std::nullopt;
  const at::Tensor result = stats_impl<Kernels>(skipping.rows(hidden, 0), weight, skipping.rows(tokens_2d, 0), tau,
                                                groups.logit_map, groups.shard, groups.tiling, top_width);
  return skipping.all_rows(result, empty_stats({}, result.size(1) - stats_column::chosen, result.options()));
}

// One round of the top_p search (search_impl in chosen_logprob/vocab_passes.h): hist and top are updated
// in place. Rows whose window is inactive (sigma 0) are left out.
template <class Kernels>
void search(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& row_max, const at::Tensor& window,
            at::Tensor hist, const std::optional<at::Tensor>& top FRL_VOCAB_PARALLEL_OPTIONS(FRL_OPTION_PARAM)) {
  const VocabParallelOptions groups{FRL_VOCAB_PARALLEL_VALUES};
  check_shard_inputs(kOp, hidden, weight, nullptr, groups);
  const int64_t N = hidden.size(0);
  check_per_token("row_max", row_max, hidden);
  TORCH_CHECK_VALUE(window.dim() == 2 && window.size(0) == N && window.size(1) == 2 &&
                        window.scalar_type() == at::kDouble && window.device() == hidden.device(),
                    kOp, ": window must be [N, 2] float64 on hidden's device");
  TORCH_CHECK_VALUE(hist.dim() == 2 && hist.size(0) == N && hist.size(1) == kSearchBins && hist.is_contiguous() &&
                        hist.scalar_type() == at::kLong && hist.device() == hidden.device(),
                    kOp, ": hist must be a contiguous [N, ", int(kSearchBins), "] int64 tensor on hidden's device");
  TORCH_CHECK_VALUE(!top || (top->dim() == 2 && top->size(0) == N && top->size(1) > top_column::values &&
                             top->is_contiguous() && top->scalar_type() == acc_dtype(hidden.scalar_type()) &&
                             top->device() == hidden.device()),
                    kOp, ": top must be a contiguous [N, ", int(top_column::values), " + K] tensor (K >= 1) in the ",
                    "accumulation dtype, on hidden's device");
  const at::DeviceGuard guard(hidden.device());
  // The row kernels pass over inactive rows themselves: compacting is the saving, capture need not.
  const RowSkipping skipping = RowSkipping::of<Kernels>(window.select(1, 0) == 0);
  if (!skipping.compacts()) {
    return search_impl<Kernels>(hidden, weight, row_max, window, hist, top, groups.logit_map, groups.shard,
                                groups.tiling);
  }
  at::Tensor hist_rows = skipping.rows(hist, 0);
  const std::optional<at::Tensor> top_rows = top ? std::optional(skipping.rows(*top, 0)) : std::nullopt;
  search_impl<Kernels>(skipping.rows(hidden, 0), weight, skipping.rows(row_max, 0), skipping.rows(window, 0),
                       hist_rows, top_rows, groups.logit_map, groups.shard, groups.tiling);
  hist.index_copy_(0, skipping.computed, hist_rows);
  if (top) top->index_copy_(0, skipping.computed, *top_rows);
}

template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& tokens, const at::Tensor& row_max,
                                            const at::Tensor& log_sum, const at::Tensor& log_sum_minus_entropy,
                                            const at::Tensor& grad_logprob, const at::Tensor& grad_entropy,
                                            const std::optional<at::Tensor>& main_grad
                                                FRL_CHOSEN_LOGPROB_OP_OPTIONS(FRL_OPTION_PARAM),
                                            const std::optional<at::Tensor>& threshold) {
  const VocabParallelOptions groups{FRL_VOCAB_PARALLEL_VALUES};
  check_scoring_inputs(hidden, weight, tokens, groups, Options{FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VALUE)},
                       threshold);
  for (const at::Tensor* t : {&row_max, &log_sum, &log_sum_minus_entropy, &grad_logprob, &grad_entropy}) {
    const bool shaped = t == &grad_logprob ? t->sizes() == tokens.sizes() : t->dim() == 1 && t->size(0) == hidden.size(0);
    TORCH_CHECK_VALUE(shaped && t->scalar_type() == acc_dtype(hidden.scalar_type()) && t->device() == hidden.device(),
                      kOp, ": row_max, log_sum, log_sum_minus_entropy and grad_entropy must be [N], grad_logprob ",
                      "tokens' shape, in the accumulation dtype, on hidden's device");
  }
  check_main_grad(kOp, main_grad, weight);
  const at::DeviceGuard guard(hidden.device());
  // The skipped rows' per-token values (an empty partial's -inf and NaN) reach no kernel: left out,
  // or zeroed with their hidden rows, so that they pass exactly 0.
  const at::Tensor tokens_2d = per_row(tokens);
  const RowSkipping skipping = skipping_ignored<Kernels>(tokens_2d, ignore_index);
  const TokenGrads token_grads{skipping.rows(row_max, 0),
                               skipping.rows(log_sum, 0),
                               skipping.rows(log_sum_minus_entropy, 0),
                               skipping.rows(per_row(grad_logprob), 0),
                               skipping.rows(grad_entropy, 0),
                               threshold ? skipping.rows(*threshold, 0) : at::Tensor()};
  auto [grad_hidden, grad_weight] = backward_impl<Kernels>(skipping.rows(hidden, 0), weight,
                                                           skipping.rows(tokens_2d, 0), token_grads, main_grad,
                                                           groups.logit_map, groups.shard, groups.tiling);
  return {skipping.all_rows(grad_hidden, at::zeros({}, grad_hidden.options())), grad_weight};
}

template <class Kernels>
at::Tensor combine(const at::Tensor& partials) {
  TORCH_CHECK_VALUE(partials.dim() == 3 && partials.size(2) >= stats_column::chosen, kOp, ": partials must be [ranks, N, ",
                    int(stats_column::chosen), " + k], got ", partials.sizes());
  const int64_t columns = partials.size(2);
  return combine_partials<Params, Kernels>(kOp, partials, columns, columns, [&](Params& p) {
    p.tokens_per_row = columns - stats_column::chosen;
  });
}

}  // namespace fused_rl_ops::chosen_logprob
