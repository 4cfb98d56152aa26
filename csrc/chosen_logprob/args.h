// Argument checks shared by the CPU and CUDA entry points of chosen_logprob's ops.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

namespace fused_rl_ops::chosen_logprob {

inline void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                         double temperature, int64_t chunk_size, int64_t row_block, int64_t pass_rows,
                         std::optional<double> softcap) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "chosen_logprob: hidden must be [N, H] and weight [V, H], got ", hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "chosen_logprob: hidden and weight dtypes differ");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == hidden.size(0) && tokens.scalar_type() == at::kLong,
              "chosen_logprob: tokens must be int64 [N]");
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == tokens.device(),
              "chosen_logprob: hidden, weight and tokens must be on one device");
  TORCH_CHECK(temperature > 0 && std::isfinite(temperature), "chosen_logprob: temperature must be > 0");
  TORCH_CHECK(!softcap || (*softcap > 0 && std::isfinite(*softcap)),
              "chosen_logprob: softcap must be None or a positive finite number");
  TORCH_CHECK(chunk_size > 0, "chosen_logprob: chunk_size must be > 0");
  TORCH_CHECK(row_block >= 0 && pass_rows >= 0, "chosen_logprob: row_block and pass_rows must be >= 0 (0: all rows)");
}

inline void check_backward_args(const at::Tensor& weight, int64_t valid_rows,
                                const std::optional<at::Tensor>& main_grad) {
  TORCH_CHECK(valid_rows >= 0 && valid_rows <= weight.size(0), "chosen_logprob backward: valid_rows ", valid_rows,
              " outside [0, ", weight.size(0), "]");
  if (!main_grad) return;
  TORCH_CHECK(main_grad->sizes() == weight.sizes() && main_grad->device() == weight.device() &&
                  (main_grad->scalar_type() == at::kFloat || main_grad->scalar_type() == weight.scalar_type()),
              "chosen_logprob: main_grad must have weight's shape ", weight.sizes(), " and device, in float32 or ",
              "weight's dtype; got ", main_grad->sizes(), " ", main_grad->scalar_type(), " on ", main_grad->device());
}

inline void check_combine_input(const at::Tensor& partials) {
  TORCH_CHECK(partials.dim() == 3 && partials.size(2) == 4,
              "chosen_logprob_combine: partials must be [ranks, N, 4], got ", partials.sizes());
  TORCH_CHECK(partials.scalar_type() == at::kFloat || partials.scalar_type() == at::kDouble,
              "chosen_logprob_combine: partials must be float32 or float64");
}

}  // namespace fused_rl_ops::chosen_logprob
