// The checks an op over a vocab-parallel shard makes of its model tensors and shared option groups,
// in the words of the Python checks.
#pragma once

#include <ATen/ATen.h>

#include "common/torch_utils.h"
#include "vocab_parallel/options.h"

namespace fused_rl_ops {

// hidden [N, H] (H >= 1), weight [V, H] in hidden's floating dtype, int64 tokens [N] or [N, k]
// (k >= 1 tokens per position; null: none), on one device; the groups, valid_rows at most V.
inline void check_shard_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor* tokens, const VocabParallelOptions& groups) {
  check_options(op, groups);
  check_float_dtype(op, "hidden", hidden);
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), op, ": weight must have hidden's dtype ",
                   hidden.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK_TYPE(!tokens || tokens->scalar_type() == at::kLong, op, ": tokens must be int64, got ",
                   tokens->scalar_type());
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) >= 1 && weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    op, ": expected hidden [N, H] with H >= 1 and weight [V, H], got ", hidden.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(!tokens || ((tokens->dim() == 1 || (tokens->dim() == 2 && tokens->size(1) >= 1)) &&
                                 tokens->size(0) == hidden.size(0)),
                    op, ": tokens must be [N] or [N, k] with k >= 1 (N: hidden's rows), got ", tokens->sizes());
  TORCH_CHECK_VALUE(weight.device() == hidden.device() && (!tokens || tokens->device() == hidden.device()), op,
                    ": all tensors must be on one device, got hidden on ", hidden.device(), ", weight on ",
                    weight.device(), tokens ? ", tokens on " : "", tokens ? tokens->device() : hidden.device());
  TORCH_CHECK_VALUE(groups.shard.valid_rows.value_or(0) <= weight.size(0), op,
                    ": valid_rows must be None or at most weight's rows ", weight.size(0), ", got ",
                    *groups.shard.valid_rows);
}

}  // namespace fused_rl_ops
