// chosen_logprob's ops, one implementation for the CPU and CUDA backends (cpu.cpp's, cuda.cpp's),
// each device file registering these templates with its own Backend: the schema's arguments
// gathered into Options and TokenGrads (chosen_logprob/chunks.h) and Params. The user-facing
// argument checks are fused_rl_ops/chosen_logprob.py's; these check only what the kernels' memory
// accesses rely on, and that the chunk loop advances.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "chosen_logprob/chunks.h"

namespace fused_rl_ops::chosen_logprob {

inline void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                         int64_t chunk_size) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1) && tokens.dim() == 1 &&
                  tokens.size(0) == hidden.size(0) && tokens.scalar_type() == at::kLong &&
                  weight.device() == hidden.device() && tokens.device() == hidden.device() && chunk_size > 0,
              "chosen_logprob ops: expected hidden [N, H], weight [V, H] and int64 tokens [N] on one device, and "
              "chunk_size > 0; got ", hidden.sizes(), ", ", weight.sizes(), ", ", tokens.scalar_type(), " ",
              tokens.sizes(), " and ", chunk_size);
}

inline Options options(double temperature, int64_t vocab_start, int64_t chunk_size, int64_t row_block,
                       int64_t pass_rows, std::optional<double> softcap) {
  return {temperature, softcap.value_or(0.0), vocab_start, chunk_size, row_block, pass_rows};
}

template <class Backend>
at::Tensor stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens, double temperature,
                 int64_t vocab_start, int64_t chunk_size, int64_t row_block, int64_t pass_rows,
                 std::optional<double> softcap) {
  check_inputs(hidden, weight, tokens, chunk_size);
  const at::DeviceGuard guard(hidden.device());
  return stats_impl<Backend>(hidden, weight, tokens,
                             options(temperature, vocab_start, chunk_size, row_block, pass_rows, softcap));
}

template <class Backend>
std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& tokens, const at::Tensor& row_max, const at::Tensor& lse,
                                            const at::Tensor& mean, const at::Tensor& grad_logprob,
                                            const at::Tensor& grad_entropy, double temperature, int64_t vocab_start,
                                            int64_t valid_rows, int64_t chunk_size, int64_t row_block,
                                            int64_t pass_rows, const std::optional<at::Tensor>& main_grad,
                                            std::optional<double> softcap) {
  check_inputs(hidden, weight, tokens, chunk_size);
  for (const at::Tensor* t : {&row_max, &lse, &mean, &grad_logprob, &grad_entropy}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == hidden.size(0) &&
                    t->scalar_type() == acc_dtype(hidden.scalar_type()) && t->device() == hidden.device(),
                "chosen_logprob_backward: row_max, lse, mean, grad_logprob and grad_entropy must be [N] in the "
                "accumulation dtype, on hidden's device");
  }
  const at::DeviceGuard guard(hidden.device());
  const TokenGrads token_grads{row_max, lse, mean, grad_logprob, grad_entropy};
  return backward_impl<Backend>(hidden, weight, tokens, token_grads, valid_rows, main_grad,
                                options(temperature, vocab_start, chunk_size, row_block, pass_rows, softcap));
}

template <class Backend>
at::Tensor combine(const at::Tensor& partials_in) {
  TORCH_CHECK(partials_in.dim() == 3 && partials_in.size(2) == 4,
              "chosen_logprob_combine: partials must be [ranks, N, 4], got ", partials_in.sizes());
  const at::DeviceGuard guard(partials_in.device());
  const at::Tensor partials = partials_in.contiguous();
  at::Tensor out = at::empty({partials.size(1), 4}, partials.options());
  Params p;
  p.partials = partials.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.ranks = partials.size(0);
  p.rows = partials.size(1);
  Backend::combine(p, partials.scalar_type());
  return out;
}

}  // namespace fused_rl_ops::chosen_logprob
