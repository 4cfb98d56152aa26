// The combine op of a vocab-parallel op (chosen_logprob, vocab_divergence): the ranks' per-row
// partials [ranks, N, columns] merged into [N, out_columns] by the op's Kernels::combine, one row
// kernel each (the op's combine_row on the CPU: combine_rows_cpu). For the torch glue.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>

namespace fused_rl_ops {

// Params: the op's launch record (its partials, out, ranks and rows are filled here, the rest by
// fill(p)).
template <class Params, class Kernels, class Fill>
at::Tensor combine_partials(const char* op, const at::Tensor& partials_in, int64_t columns, int64_t out_columns,
                            const Fill& fill) {
  TORCH_CHECK_VALUE(partials_in.dim() == 3 && partials_in.size(2) == columns, op, ": partials must be [ranks, N, ",
                    columns, "], got ", partials_in.sizes());
  TORCH_CHECK_TYPE(partials_in.scalar_type() == at::kFloat ||
                       (partials_in.scalar_type() == at::kDouble && partials_in.is_cpu()),
                   op, ": partials must be float32 (float64 only on CPU), got ", partials_in.scalar_type());
  const at::DeviceGuard guard(partials_in.device());
  const at::Tensor partials = partials_in.contiguous();
  at::Tensor out = at::empty({partials.size(1), out_columns}, partials.options());
  Params p;
  p.partials = partials.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.ranks = partials.size(0);
  p.rows = partials.size(1);
  fill(p);
  Kernels::combine(p, partials.scalar_type());
  return out;
}

// The CPU combine: combine_row(partials, ranks, rows, r, out) of the op's math for every row r, in
// the accumulation dtype acc.
template <class Params, class CombineRow>
void combine_rows_cpu(const Params& p, at::ScalarType acc, const CombineRow& combine_row) {
  AT_DISPATCH_FLOATING_TYPES(acc, "combine_cpu", [&] {
    const auto* partials = static_cast<const scalar_t*>(p.partials);
    auto* out = static_cast<scalar_t*>(p.out);
    at::parallel_for(0, p.rows, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) combine_row(partials, p.ranks, p.rows, r, out);
    });
  });
}

}  // namespace fused_rl_ops
