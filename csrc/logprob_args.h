// Argument checks shared by the CPU and CUDA entry points of chosen_logprob's ops.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

namespace fused_rl_ops {

inline void check_logprob_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                                 double temperature, int64_t chunk_size, int64_t row_block, int64_t pass_rows) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "chosen_logprob: hidden must be [N, H] and weight [V, H], got ", hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "chosen_logprob: hidden and weight dtypes differ");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == hidden.size(0) && tokens.scalar_type() == at::kLong,
              "chosen_logprob: tokens must be int64 [N]");
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == tokens.device(),
              "chosen_logprob: hidden, weight and tokens must be on one device");
  TORCH_CHECK(temperature > 0 && std::isfinite(temperature), "chosen_logprob: temperature must be > 0");
  TORCH_CHECK(chunk_size > 0, "chosen_logprob: chunk_size must be > 0");
  TORCH_CHECK(row_block >= 0 && pass_rows >= 0, "chosen_logprob: row_block and pass_rows must be >= 0 (0: all rows)");
}

inline void check_combine_input(const at::Tensor& partials) {
  TORCH_CHECK(partials.dim() == 3 && partials.size(2) == 4,
              "logprob_combine: partials must be [ranks, N, 4], got ", partials.sizes());
  TORCH_CHECK(partials.scalar_type() == at::kFloat || partials.scalar_type() == at::kDouble,
              "logprob_combine: partials must be float32 or float64");
}

}  // namespace fused_rl_ops
