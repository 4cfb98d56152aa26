// The vocab-chunk loops of vocab_divergence: chosen_logprob's loop (chosen_logprob/chunks.h, which
// lists what a device's Kernels supply) walks the student's logits, and TeacherLogits computes the
// teacher's over the same rows and vocab chunk beside them, so that each row kernel sees both
// models' logits of one chunk; no [N, V] tensor. The Kernels' row kernels here: stats_rows,
// mixture_rows, grad_rows(params, acc, grads), combine (vocab_divergence/params.h).
#pragma once

#include <ATen/ATen.h>

#include "chosen_logprob/chunks.h"
#include "vocab_divergence/math.h"
#include "vocab_divergence/params.h"

namespace fused_rl_ops::vocab_divergence {

using chosen_logprob::ChunkStep;
using chosen_logprob::RowTiling;
using chosen_logprob::VocabTiling;

// The teacher's raw logits of a chunk step of the loop, [padded rows, n] in the accumulation dtype,
// in a workspace of its own (chunk wide) reused by every chunk; the teacher's hidden rows meet the
// GEMMs in the same blocks as the student's (RowTiling), so batch invariance holds for both.
template <class Kernels>
class TeacherLogits {
  // All of a pass's rows per call: the loop must call on_chunk once per chunk, not per row piece
  // from several threads at once (chosen_logprob/chunks.h, RowPieces).
  static_assert(Kernels::kPieceRows == 0, "the teacher's logits take whole passes");

 public:
  TeacherLogits(const at::Tensor& hidden, const at::Tensor& weight, const RowTiling& tiling, int64_t chunk)
      : tiling_(tiling), acc_(acc_dtype(hidden.scalar_type())), weight_(weight.contiguous()) {
    hidden_ = chosen_logprob::aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc_), tiling);
    if (tiling.tail_rows() > 0) {
      tail_ = at::zeros({tiling.block, hidden.size(1)}, hidden_.options());
      tail_.narrow(0, 0, tiling.tail_rows()).copy_(hidden_.narrow(0, tiling.last_full_row(), tiling.tail_rows()));
    }
    workspace_ = at::empty({tiling.pass * chunk}, hidden.options().dtype(acc_));
  }

  at::Tensor of(const ChunkStep& step) {
    at::Tensor logits = workspace_.narrow(0, 0, tiling_.padded(step.rows) * step.n).view({-1, step.n});
    const at::Tensor w_chunk = Kernels::gemm_operand(weight_.narrow(0, step.c0, step.n), acc_);
    for (int64_t b0 = 0; b0 < step.rows; b0 += tiling_.block) {
      at::Tensor out = logits.narrow(0, b0, tiling_.block);
      Kernels::logits(chosen_logprob::block_rows(hidden_, tail_, tiling_, step.r0 + b0), w_chunk, out);
    }
    return logits;
  }

 private:
  RowTiling tiling_;
  at::ScalarType acc_;
  at::Tensor hidden_, tail_, weight_, workspace_;
};

// What every launch of one call shares: the maps, the kind and beta.
struct CallConstants {
  LogitMap logit_map, teacher_logit_map;
  int kind;
  double beta;
};

// The Params of a row kernel over on_chunk's rows (step.begin to step.end of the pass) of one chunk's
// logits of both models.
inline Params row_params(const at::Tensor& logits, const at::Tensor& teacher_logits, const ChunkStep& step,
                         const CallConstants& call) {
  Params p;
  p.logits = logits.narrow(0, step.begin, step.end - step.begin).const_data_ptr();
  p.teacher_logits = teacher_logits.narrow(0, step.begin, step.end - step.begin).const_data_ptr();
  p.rows = step.end - step.begin;
  p.cols = step.n;
  p.logit_map = call.logit_map;
  p.teacher_logit_map = call.teacher_logit_map;
  p.kind = call.kind;
  p.beta = call.beta;
  return p;
}

// Runs on_chunk(params, step) for every chunk of the first valid_rows rows of both weights (the rest
// padding) and every pass of token rows, with both models' logits in params.
template <class Kernels, class OnChunk>
void for_each_chunk_pair(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& teacher_hidden,
                         const at::Tensor& teacher_weight, int64_t valid_rows, const CallConstants& call,
                         const Tiling& tiling_options, const OnChunk& on_chunk) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const RowTiling tiling(hidden.size(0), tiling_options.row_block, tiling_options.pass_rows);
  const VocabTiling vocab(valid_rows, tiling_options.chunk_size, 1);
  TeacherLogits<Kernels> teacher(teacher_hidden, teacher_weight, tiling, vocab.chunk);
  chosen_logprob::for_each_logits_chunk<Kernels>(
      chosen_logprob::aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling),
      weight.narrow(0, 0, valid_rows), vocab, tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        on_chunk(row_params(logits, teacher.of(step), step, call), step);
      });
}

// Both models' per-token Sides (stats_column) over this shard's valid rows.
template <class Kernels>
at::Tensor stats_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& teacher_hidden,
                      const at::Tensor& teacher_weight, int64_t valid_rows, const CallConstants& call,
                      const Tiling& tiling) {
  const auto acc = acc_dtype(hidden.scalar_type());
  at::Tensor stats = at::zeros({hidden.size(0), stats_column::count}, hidden.options().dtype(acc));
  stats.select(1, stats_column::student_max).fill_(-INFINITY);
  stats.select(1, stats_column::teacher_max).fill_(-INFINITY);
  if (hidden.size(0) == 0 || valid_rows == 0) return stats;
  for_each_chunk_pair<Kernels>(hidden, weight, teacher_hidden, teacher_weight, valid_rows, call, tiling,
                               [&](Params p, const ChunkStep& step) {
                                 p.stats = step.rows_of(stats).mutable_data_ptr();
                                 Kernels::stats_rows(p, acc);
                               });
  return stats;
}

// jsd's per-token sums (mixture_column) over this shard's valid rows, from the merged rows
// ([N, combined_column::count]).
template <class Kernels>
at::Tensor mixture_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& teacher_hidden,
                        const at::Tensor& teacher_weight, const at::Tensor& rows, int64_t valid_rows,
                        const CallConstants& call, const Tiling& tiling) {
  const auto acc = acc_dtype(hidden.scalar_type());
  at::Tensor sums = at::zeros({hidden.size(0), mixture_column::count}, hidden.options().dtype(acc));
  if (hidden.size(0) == 0 || valid_rows == 0) return sums;
  const at::Tensor row = rows.contiguous();
  for_each_chunk_pair<Kernels>(hidden, weight, teacher_hidden, teacher_weight, valid_rows, call, tiling,
                               [&](Params p, const ChunkStep& step) {
                                 p.row = step.rows_of(row).const_data_ptr();
                                 p.mixture = step.rows_of(sums).mutable_data_ptr();
                                 Kernels::mixture_rows(p, acc);
                               });
  return sums;
}

// The student's gradients (chosen_logprob's gradient_loop) of sum(grad * divergence), from the merged
// rows and the row term (Params::row_term).
template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& teacher_hidden, const at::Tensor& teacher_weight,
                                                 const at::Tensor& rows, const at::Tensor& row_term,
                                                 const at::Tensor& grad, const std::optional<at::Tensor>& main_grad,
                                                 int64_t valid_rows, const CallConstants& call,
                                                 const Tiling& tiling_options) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const at::Tensor row = rows.contiguous(), term = row_term.contiguous(), g = grad.contiguous();
  const RowTiling tiling(hidden.size(0), tiling_options.row_block, tiling_options.pass_rows);
  TeacherLogits<Kernels> teacher(teacher_hidden, teacher_weight, tiling,
                                 VocabTiling(valid_rows, tiling_options.chunk_size, 1).chunk);
  return chosen_logprob::gradient_loop<Kernels>(
      hidden, weight, valid_rows, main_grad, tiling_options,
      [&](const at::Tensor& logits, const ChunkStep& step, const at::Tensor& d) {
        Params p = row_params(logits, teacher.of(step), step, call);
        p.row = step.rows_of(row).const_data_ptr();
        p.row_term = step.rows_of(term).const_data_ptr();
        p.grad = step.rows_of(g).const_data_ptr();
        p.grads = d.data_ptr();
        p.grads_stride = d.stride(0);
        Kernels::grad_rows(p, acc, d.scalar_type());
      });
}

}  // namespace fused_rl_ops::vocab_divergence
