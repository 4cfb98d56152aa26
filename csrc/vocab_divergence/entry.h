// vocab_divergence's ops, written once over a device's Kernels, which each device file registers.
// Each checks its contract first (its option groups, and what its kernels rely on, in the words of
// the Python checks), leaves out the masked rows (RowSkipping), then walks the chunks.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "vocab_divergence/vocab_passes.h"
#include "vocab_divergence/options.h"
#include "vocab_parallel/combine.h"
#include "vocab_parallel/row_skipping.h"

namespace fused_rl_ops::vocab_divergence {

constexpr const char* kOp = "vocab_divergence";

// Every option group of the ops, as each makes them from its parameters of the options' names:
// OpOptions{FRL_VOCAB_DIVERGENCE_VALUES}.
struct OpOptions {
  VocabParallelOptions shared;
  LogitMap teacher_logit_map;
  Options own;

  CallConstants call() const { return {shared.logit_map, teacher_logit_map, int(own.kind), own.beta}; }
};

#define FRL_VOCAB_DIVERGENCE_VALUES \
  {FRL_VOCAB_PARALLEL_VALUES}, {FRL_TEACHER_LOGIT_MAP(FRL_OPTION_VALUE)}, {FRL_VOCAB_DIVERGENCE_OPTIONS(FRL_OPTION_VALUE)}

// The four model tensors: hidden [N, H] and weight [V, H] in one floating dtype, teacher_hidden
// [N, H_t] and teacher_weight [V, H_t] in one (of the same accumulation dtype), mask [N] bool or
// none, on one device; the option groups, valid_rows at most V.
inline void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& teacher_hidden,
                         const at::Tensor& teacher_weight, const std::optional<at::Tensor>& mask,
                         const OpOptions& options) {
  const VocabParallelOptions& groups = options.shared;
  check_options(kOp, groups.logit_map);
  check_options(kOp, options.teacher_logit_map, "teacher_");
  check_options(kOp, groups.shard);
  check_options(kOp, groups.tiling);
  check_options(kOp, options.own);
  check_float_dtype(kOp, "hidden", hidden);
  check_float_dtype(kOp, "teacher_hidden", teacher_hidden);
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), kOp, ": weight must have hidden's dtype ",
                   hidden.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK_TYPE(teacher_weight.scalar_type() == teacher_hidden.scalar_type(), kOp,
                   ": teacher_weight must have teacher_hidden's dtype ", teacher_hidden.scalar_type(), ", got ",
                   teacher_weight.scalar_type());
  TORCH_CHECK_TYPE(acc_dtype(teacher_hidden.scalar_type()) == acc_dtype(hidden.scalar_type()), kOp,
                   ": float64 inputs must be float64 for both models, got ", hidden.scalar_type(), " and ",
                   teacher_hidden.scalar_type());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) >= 1 && weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    kOp, ": expected hidden [N, H] with H >= 1 and weight [V, H], got ", hidden.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(teacher_hidden.dim() == 2 && teacher_hidden.size(0) == hidden.size(0) &&
                        teacher_hidden.size(1) >= 1 && teacher_weight.dim() == 2 &&
                        teacher_weight.size(0) == weight.size(0) && teacher_weight.size(1) == teacher_hidden.size(1),
                    kOp, ": expected teacher_hidden [N, H_t] with H_t >= 1 and teacher_weight [V, H_t] (hidden's N, ",
                    "weight's V), got ", teacher_hidden.sizes(), " and ", teacher_weight.sizes());
  check_row_mask(kOp, mask, hidden);
  for (const at::Tensor* t : {&weight, &teacher_hidden, &teacher_weight}) check_same_device(kOp, hidden, *t, "tensors");
  TORCH_CHECK_VALUE(groups.shard.valid_rows.value_or(0) <= weight.size(0), kOp,
                    ": valid_rows must be None or at most weight's rows ", weight.size(0), ", got ",
                    *groups.shard.valid_rows);
}

// [N, columns] per-token tensors the ops take: in the accumulation dtype, on hidden's device (columns
// 0: [N]).
inline void check_per_token(const char* what, const at::Tensor& t, const at::Tensor& hidden, int64_t columns) {
  const bool shape_ok = columns == 0 ? t.dim() == 1 : (t.dim() == 2 && t.size(1) == columns);
  TORCH_CHECK_VALUE(shape_ok && t.size(0) == hidden.size(0) && t.scalar_type() == acc_dtype(hidden.scalar_type()) &&
                        t.device() == hidden.device(),
                    kOp, ": ", what, " must be [N", columns ? ", " + std::to_string(columns) : std::string(),
                    "] in the accumulation dtype, on hidden's device");
}

// A row of empty Sides (partial_empty): what a row no shard computes holds.
inline at::Tensor empty_stats_row(const at::TensorOptions& options) {
  at::Tensor row = at::zeros({stats_column::count}, options);
  row.select(0, stats_column::student_max).fill_(-INFINITY);
  row.select(0, stats_column::teacher_max).fill_(-INFINITY);
  return row;
}

template <class Kernels>
at::Tensor stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& teacher_hidden,
                 const at::Tensor& teacher_weight,
                 const std::optional<at::Tensor>& mask FRL_VOCAB_DIVERGENCE_OP_OPTIONS(FRL_OPTION_PARAM)) {
  const OpOptions options{FRL_VOCAB_DIVERGENCE_VALUES};
  check_inputs(hidden, weight, teacher_hidden, teacher_weight, mask, options);
  const at::DeviceGuard guard(hidden.device());
  const RowSkipping skipping = skipping_masked<Kernels>(mask);
  const at::Tensor result = stats_impl<Kernels>(
      skipping.rows(hidden, 0), weight, skipping.rows(teacher_hidden, 0), teacher_weight,
      options.shared.shard.valid_rows.value_or(weight.size(0)), options.call(), options.shared.tiling);
  return skipping.all_rows(result, empty_stats_row(result.options()));
}

template <class Kernels>
at::Tensor mixture(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& teacher_hidden,
                   const at::Tensor& teacher_weight, const std::optional<at::Tensor>& mask,
                   const at::Tensor& rows FRL_VOCAB_DIVERGENCE_OP_OPTIONS(FRL_OPTION_PARAM)) {
  const OpOptions options{FRL_VOCAB_DIVERGENCE_VALUES};
  check_inputs(hidden, weight, teacher_hidden, teacher_weight, mask, options);
  check_per_token("rows", rows, hidden, combined_column::count);
  const at::DeviceGuard guard(hidden.device());
  // The masked rows' merged rows (empty: NaN) reach no kernel: left out, or zeroed.
  const RowSkipping skipping = skipping_masked<Kernels>(mask);
  const at::Tensor result = mixture_impl<Kernels>(
      skipping.rows(hidden, 0), weight, skipping.rows(teacher_hidden, 0), teacher_weight, skipping.rows(rows, 0),
      options.shared.shard.valid_rows.value_or(weight.size(0)), options.call(), options.shared.tiling);
  return skipping.all_rows(result, at::zeros({}, result.options()));
}

template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& teacher_hidden, const at::Tensor& teacher_weight,
                                            const std::optional<at::Tensor>& mask, const at::Tensor& rows,
                                            const at::Tensor& row_term, const at::Tensor& grad,
                                            const std::optional<at::Tensor>& main_grad
                                                FRL_VOCAB_DIVERGENCE_OP_OPTIONS(FRL_OPTION_PARAM)) {
  const OpOptions options{FRL_VOCAB_DIVERGENCE_VALUES};
  check_inputs(hidden, weight, teacher_hidden, teacher_weight, mask, options);
  check_per_token("rows", rows, hidden, combined_column::count);
  check_per_token("row_term", row_term, hidden, 0);
  check_per_token("grad", grad, hidden, 0);
  check_main_grad(kOp, main_grad, weight);
  const at::DeviceGuard guard(hidden.device());
  // The masked rows' per-token values (NaN) reach no kernel: left out, or zeroed with their hidden
  // rows, so that they pass exactly 0.
  const RowSkipping skipping = skipping_masked<Kernels>(mask);
  auto [grad_hidden, grad_weight] = backward_impl<Kernels>(
      skipping.rows(hidden, 0), weight, skipping.rows(teacher_hidden, 0), teacher_weight, skipping.rows(rows, 0),
      skipping.rows(row_term, 0), skipping.rows(grad, 0), main_grad,
      options.shared.shard.valid_rows.value_or(weight.size(0)), options.call(), options.shared.tiling);
  return {skipping.all_rows(grad_hidden, at::zeros({}, grad_hidden.options())), grad_weight};
}

template <class Kernels>
at::Tensor combine(const at::Tensor& partials) {
  return combine_partials<Params, Kernels>(kOp, partials, stats_column::count, combined_column::count, [](Params&) {});
}

}  // namespace fused_rl_ops::vocab_divergence
