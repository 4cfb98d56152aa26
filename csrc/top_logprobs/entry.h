// The top_logprobs op, one implementation for the CPU and CUDA kernels (cpu.cpp's, cuda.cpp's), each
// device file registering it with its own Kernels: each row's softmax partial and its k largest
// logits with their global ids, in one walk over the vocab chunks (vocab_parallel/chunk_loop.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>
#include <tuple>

#include "top_logprobs/options.h"
#include "top_logprobs/params.h"
#include "top_logprobs/top_ids.h"
#include "vocab_parallel/checks.h"
#include "vocab_parallel/chunk_loop.h"
#include "vocab_parallel/row_skipping.h"
#include "vocab_parallel/stats_rows.h"

namespace fused_rl_ops::top_logprobs {

constexpr const char* kOp = "top_logprobs";

// The id of the rows the op does not compute: before every real id, so that the ranks' merged tops
// keep it; the Python function's NOT_COMPUTED.
constexpr int64_t kNotComputed = -1;

// Each row's partials (stats_column, no chosen logits: [N, 3]) and its k largest logits with their
// global ids ([N, k] each, from placeholders), over this shard's valid rows.
template <class Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_logprobs_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                                 const VocabParallelOptions& groups, int64_t k) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = groups.shard.valid_rows.value_or(weight.size(0));
  const at::TensorOptions acc_options = hidden.options().dtype(acc);
  at::Tensor stats = empty_stats({N}, 0, acc_options);
  at::Tensor values = at::full({N, k}, -INFINITY, acc_options);
  at::Tensor ids = at::full({N, k}, kNoId, acc_options.dtype(at::kLong));
  if (N == 0 || V == 0) return {stats, values, ids};
  for_each_chunk<Kernels>(hidden, weight, V, groups.tiling, [&](const at::Tensor& logits, const ChunkStep& step) {
    Params p = chunk_params<Params>(logits, step, groups.logit_map, groups.shard);
    p.stats = step.rows_out(stats);
    p.top = step.rows_out(values);
    p.top_ids = step.rows_out<int64_t>(ids);
    p.top_width = k;
    Kernels::stats_top_ids_rows(p, acc);
  });
  return {stats, values, ids};
}

// The op: top_logprobs_impl over the rows mask keeps (True); the others get an empty partial,
// values -inf and ids kNotComputed.
template <class Kernels>
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats(const at::Tensor& hidden, const at::Tensor& weight,
                                                     const std::optional<at::Tensor>& mask
                                                         FRL_TOP_LOGPROBS_OP_OPTIONS(FRL_OPTION_PARAM)) {
  const VocabParallelOptions groups{FRL_VOCAB_PARALLEL_VALUES};
  check_shard_inputs(kOp, hidden, weight, nullptr, groups);
  check_options(kOp, Options{FRL_TOP_LOGPROBS_OPTIONS(FRL_OPTION_VALUE)});
  check_row_mask(kOp, mask, hidden);
  const at::DeviceGuard guard(hidden.device());
  const RowSkipping skipping = skipping_masked<Kernels>(mask);
  const auto [partials, values, ids] = top_logprobs_impl<Kernels>(skipping.rows(hidden, 0), weight, groups, k);
  return {skipping.all_rows(partials, empty_stats({}, 0, partials.options())),
          skipping.all_rows(values, at::full({}, -INFINITY, values.options())),
          skipping.all_rows(ids, at::full({}, kNotComputed, ids.options()))};
}

}  // namespace fused_rl_ops::top_logprobs
