// RowSkipping: how an op leaves out the rows it need not compute (chosen_logprob's ignored tokens,
// vocab_divergence's and top_logprobs' masked positions), inside the op.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "common/torch_utils.h"

namespace fused_rl_ops {

// The rows an op leaves out (skipped: [N] bool; undefined, none) and how. Its count is read here,
// inside the op, so that a traced caller (torch.compile) keeps the saving: the other rows are
// gathered (compact: index_select by `computed`), computed and put back. During CUDA graph capture
// no count may be read: every row is computed, the skipped ones on zeroed hidden rows and with
// zeroed per-token inputs, and their results replaced after, so that the results are the same.
struct RowSkipping {
  at::Tensor skipped;   // [N] bool, undefined: no row skipped
  at::Tensor computed;  // [count] int64, the rows computed when compacting; undefined: every row

  template <class Kernels>
  static RowSkipping of(const at::Tensor& skipped) {
    if (Kernels::capturing()) return {skipped, at::Tensor()};
    at::Tensor computed = at::nonzero(skipped.logical_not()).squeeze(1);  // the host reads its length
    if (computed.size(0) == skipped.size(0)) return {};
    return {skipped, computed};
  }
  bool compacts() const { return computed.defined(); }
  // skipped as a mask of t's rows.
  at::Tensor mask_of(const at::Tensor& t) const { return t.dim() > 1 ? skipped.unsqueeze(1) : skipped; }
  // t's rows as the chunk loop takes them: the computed ones; or where every row is computed,
  // t with the skipped rows set to `fill` (hidden's to 0, so that nothing in them reaches a sum).
  at::Tensor rows(const at::Tensor& t, double fill) const {
    if (compacts()) return t.index_select(0, computed);
    return skipped.defined() ? t.masked_fill(mask_of(t), fill) : t;
  }
  // A result of the computed rows as one of every row: `skipped_row` ([columns], or a scalar) at the
  // rows left out.
  at::Tensor all_rows(const at::Tensor& result, const at::Tensor& skipped_row) const {
    if (compacts()) {
      std::vector<int64_t> shape = result.sizes().vec();
      shape[0] = skipped.size(0);
      return skipped_row.expand(shape).clone(at::MemoryFormat::Contiguous).index_copy_(0, computed, result);
    }
    if (!skipped.defined()) return result;
    return at::where(mask_of(result), skipped_row, result);
  }
};

// A mask of the rows an op computes (True: computed): none, or [N] bool (hidden's rows) on hidden's device.
inline void check_row_mask(const char* op, const std::optional<at::Tensor>& mask, const at::Tensor& hidden) {
  if (!mask) return;
  TORCH_CHECK_VALUE(mask->dim() == 1 && mask->size(0) == hidden.size(0) && mask->scalar_type() == at::kBool, op,
                    ": mask must be None or [N] bool (hidden's rows)");
  check_same_device(op, hidden, *mask, "hidden and mask");
}

// The masked rows (mask False) as an op leaves them out; none without a mask.
template <class Kernels>
RowSkipping skipping_masked(const std::optional<at::Tensor>& mask) {
  return mask ? RowSkipping::of<Kernels>(mask->logical_not()) : RowSkipping{};
}

}  // namespace fused_rl_ops
