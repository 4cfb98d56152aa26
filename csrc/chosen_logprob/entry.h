// chosen_logprob's ops, one implementation for the CPU and CUDA kernels (cpu.cpp's, cuda.cpp's),
// each device file registering these templates with its own Kernels. Each op checks its contract
// first: the options as chosen_logprob/options.h declares them, and the shapes, dtypes and devices
// its kernels rely on, in the words of fused_rl_ops/chosen_logprob.py's checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "chosen_logprob/chunks.h"

namespace fused_rl_ops::chosen_logprob {

constexpr const char* kOp = "chosen_logprob";

// hidden [N, H] (H >= 1), weight [V, H] in hidden's floating dtype, int64 tokens [N] (the search
// op takes none: null), on one device, and the options, valid_rows at most V.
inline void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor* tokens,
                         const Options& options) {
  check_options(kOp, options);
  check_float_dtype(kOp, "hidden", hidden);
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), kOp, ": weight must have hidden's dtype ",
                   hidden.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK_TYPE(!tokens || tokens->scalar_type() == at::kLong, kOp, ": tokens must be int64, got ",
                   tokens->scalar_type());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) >= 1 && weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    kOp, ": expected hidden [N, H] with H >= 1 and weight [V, H], got ", hidden.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(!tokens || (tokens->dim() == 1 && tokens->size(0) == hidden.size(0)), kOp,
                    ": tokens must be [N] (hidden's rows), got ", tokens->sizes());
  TORCH_CHECK_VALUE(weight.device() == hidden.device() && (!tokens || tokens->device() == hidden.device()), kOp,
                    ": all tensors must be on one device, got hidden on ", hidden.device(), ", weight on ",
                    weight.device(), tokens ? ", tokens on " : "", tokens ? tokens->device() : hidden.device());
  TORCH_CHECK_VALUE(options.valid_rows.value_or(0) <= weight.size(0), kOp, ": valid_rows must be None or at most ",
                    "weight's rows ", weight.size(0), ", got ", *options.valid_rows);
}

// An optional per-token tensor t (threshold): [N] in the accumulation dtype on hidden's device.
inline void check_per_token(const char* what, const std::optional<at::Tensor>& t, const at::Tensor& hidden) {
  TORCH_CHECK_VALUE(!t || (t->dim() == 1 && t->size(0) == hidden.size(0) &&
                           t->scalar_type() == acc_dtype(hidden.scalar_type()) && t->device() == hidden.device()),
                    kOp, ": ", what, " must be [N] in the accumulation dtype, on hidden's device");
}

template <class Kernels>
at::Tensor stats(const at::Tensor& hidden, const at::Tensor& weight,
                 const at::Tensor& tokens FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_PARAM),
                 const std::optional<at::Tensor>& threshold) {
  const Options options{FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VALUE)};
  check_inputs(hidden, weight, &tokens, options);
  check_per_token("threshold", threshold, hidden);
  const at::DeviceGuard guard(hidden.device());
  return stats_impl<Kernels>(hidden, weight, tokens, threshold, options);
}

// One round of the top_p search (search_impl in chosen_logprob/chunks.h): hist and top are updated
// in place.
template <class Kernels>
void search(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& row_max, const at::Tensor& window,
            at::Tensor hist, const std::optional<at::Tensor>& top FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_PARAM)) {
  const Options options{FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VALUE)};
  check_inputs(hidden, weight, nullptr, options);
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
  search_impl<Kernels>(hidden, weight, row_max, window, hist, top, options);
}

template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& tokens, const at::Tensor& row_max,
                                            const at::Tensor& log_sum, const at::Tensor& log_sum_minus_entropy,
                                            const at::Tensor& grad_logprob, const at::Tensor& grad_entropy,
                                            const std::optional<at::Tensor>& main_grad
                                                FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_PARAM),
                                            const std::optional<at::Tensor>& threshold) {
  const Options options{FRL_CHOSEN_LOGPROB_OPTIONS(FRL_OPTION_VALUE)};
  check_inputs(hidden, weight, &tokens, options);
  check_per_token("threshold", threshold, hidden);
  const TokenGrads token_grads{row_max,      log_sum,      log_sum_minus_entropy,
                               grad_logprob, grad_entropy, threshold.value_or(at::Tensor())};
  for (const at::Tensor* t : {&row_max, &log_sum, &log_sum_minus_entropy, &grad_logprob, &grad_entropy}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == hidden.size(0) &&
                          t->scalar_type() == acc_dtype(hidden.scalar_type()) && t->device() == hidden.device(),
                      kOp, ": row_max, log_sum, log_sum_minus_entropy, grad_logprob and grad_entropy must be [N] in ",
                      "the accumulation dtype, on hidden's device");
  }
  TORCH_CHECK_VALUE(!main_grad || (main_grad->sizes() == weight.sizes() && main_grad->device() == weight.device() &&
                                   (main_grad->scalar_type() == at::kFloat ||
                                    main_grad->scalar_type() == weight.scalar_type())),
                    kOp, ": main_grad must be a float32 (or weight-dtype) tensor of weight's shape ", weight.sizes(),
                    " on ", weight.device());
  const at::DeviceGuard guard(hidden.device());
  return backward_impl<Kernels>(hidden, weight, tokens, token_grads, main_grad, options);
}

template <class Kernels>
at::Tensor combine(const at::Tensor& partials_in) {
  TORCH_CHECK_VALUE(partials_in.dim() == 3 && partials_in.size(2) == stats_column::count, kOp,
                    ": partials must be [ranks, N, ", int(stats_column::count), "], got ", partials_in.sizes());
  TORCH_CHECK_TYPE(partials_in.scalar_type() == at::kFloat || (partials_in.scalar_type() == at::kDouble &&
                                                                partials_in.is_cpu()),
                   kOp, ": partials must be float32 (float64 only on CPU), got ", partials_in.scalar_type());
  const at::DeviceGuard guard(partials_in.device());
  const at::Tensor partials = partials_in.contiguous();
  at::Tensor out = at::empty({partials.size(1), stats_column::count}, partials.options());
  Params p;
  p.partials = partials.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.ranks = partials.size(0);
  p.rows = partials.size(1);
  Kernels::combine(p, partials.scalar_type());
  return out;
}

}  // namespace fused_rl_ops::chosen_logprob
