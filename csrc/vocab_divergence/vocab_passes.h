// The vocab-chunk loops of vocab_divergence: the engine's loop (vocab_parallel/chunk_loop.h, which
// lists what a device's Kernels supply) walks the student's logits, and TeacherLogits computes the
// teacher's over the same rows and vocab chunk beside them, so that each row kernel sees both
// models' logits of one chunk; no [N, V] tensor. The Kernels' row kernels here: stats_rows,
// mixture_rows, grad_rows(params, acc, grads), combine (vocab_divergence/params.h).
#pragma once

#include <ATen/ATen.h>

#include <mutex>

#include "vocab_divergence/math.h"
#include "vocab_divergence/params.h"
#include "vocab_parallel/chunk_loop.h"
#include "vocab_parallel/gradient_loop.h"

namespace fused_rl_ops::vocab_divergence {

// The teacher's raw logits of on_chunk's rows of a chunk step, computed right before the row kernels
// read them by GEMMs of the student's shapes (so batch invariance holds for both models), in a
// workspace of their own laid out chunk-wide, so that pieces of chunks of different widths never
// share bytes. A group's weight rows are made GEMM operands once (on the CPU, fp32 copies), one group
// at a time (copies_rows: the chunk loop then runs the groups in turn).
template <class Kernels>
class TeacherLogits {
 public:
  TeacherLogits(const at::Tensor& hidden, const at::Tensor& weight, const RowTiling& tiling, int64_t chunk)
      : tiling_(tiling), chunk_(chunk), acc_(acc_dtype(hidden.scalar_type())), weight_(weight.contiguous()) {
    hidden_ = aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc_), tiling);
    if (tiling.tail_rows() > 0) {
      tail_ = at::zeros({tiling.block, hidden.size(1)}, hidden_.options());
      tail_.narrow(0, 0, tiling.tail_rows()).copy_(hidden_.narrow(0, tiling.last_full_row(), tiling.tail_rows()));
    }
    workspace_ = at::empty({tiling.pass * chunk}, hidden.options().dtype(acc_));
    for (int64_t r0 = 0; r0 < tiling.N; r0 += tiling.pass) {  // each pass's pieces of hidden, made once
      const RowPieces pieces(tiling, tiling.padded(std::min(tiling.pass, tiling.N - r0)), Kernels::kPieceRows);
      hidden_pieces_.push_back(
          piece_views(pieces, [&](int64_t b0) { return block_rows(hidden_, tail_, tiling, r0 + b0); }));
    }
  }

  // Whether a group's weight rows are copies that the CPU's tasks must make in turn (GroupWork).
  bool copies_rows() const { return Kernels::kPieceRows > 0 && weight_.scalar_type() != acc_; }

  // The logits as a pass's [padded rows, n] whose rows from step.begin to the end of its last piece
  // are the step's: a view that starts begin * (chunk - n) elements in, where its row begin lies at
  // begin * chunk (its rows before begin are other pieces' bytes, never read).
  at::Tensor of(const ChunkStep& step) {
    const RowPieces pieces(tiling_, tiling_.padded(step.rows), Kernels::kPieceRows);
    const int64_t first = pieces.at(step.begin), last = pieces.at(step.end - 1);
    at::Tensor logits =
        workspace_.narrow(0, step.begin * (chunk_ - step.n), pieces.end(last) * step.n).view({-1, step.n});
    const at::Tensor w_chunk = rows_of_chunk(step);
    for (int64_t i = first; i <= last; ++i) {
      at::Tensor out = logits.narrow(0, pieces.begin(i), pieces.end(i) - pieces.begin(i));
      Kernels::logits(hidden_pieces_[step.r0 / tiling_.pass][i], w_chunk, out);
    }
    return logits;
  }

 private:
  // The step's chunk of its group's weight rows; the group's rows and chunks made once.
  at::Tensor rows_of_chunk(const ChunkStep& step) {
    const std::lock_guard<std::mutex> lock(group_mutex_);
    if (group_g0_ != step.g0) {
      group_chunks_.clear();  // released before the next is made
      const at::Tensor rows = Kernels::gemm_operand(weight_.narrow(0, step.g0, step.k), acc_);
      for (int64_t c0 = 0; c0 < step.k; c0 += chunk_) {
        group_chunks_.push_back(rows.narrow(0, c0, std::min(chunk_, step.k - c0)));
      }
      group_g0_ = step.g0;
    }
    return group_chunks_[(step.c0 - step.g0) / chunk_];
  }

  RowTiling tiling_;
  int64_t chunk_;
  at::ScalarType acc_;
  at::Tensor hidden_, tail_, weight_, workspace_;
  std::vector<std::vector<at::Tensor>> hidden_pieces_;
  std::vector<at::Tensor> group_chunks_;
  int64_t group_g0_ = -1;
  std::mutex group_mutex_;
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
  p.logits = step.pass_rows_in(logits);
  p.teacher_logits = step.pass_rows_in(teacher_logits);
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
  GroupWork in_turn;
  in_turn.groups_in_turn = teacher.copies_rows();
  for_each_logits_chunk<Kernels>(
      aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling),
      weight.narrow(0, 0, valid_rows), vocab, tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        on_chunk(row_params(logits, teacher.of(step), step, call), step);
      },
      in_turn);
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
                                 p.stats = step.rows_out(stats);
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
                                 p.row = step.rows_in(row);
                                 p.mixture = step.rows_out(sums);
                                 Kernels::mixture_rows(p, acc);
                               });
  return sums;
}

// The student's gradients (the engine's gradient_loop) of sum(grad * divergence), from the merged
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
  return gradient_loop<Kernels>(
      hidden, weight, valid_rows, main_grad, tiling_options,
      [&](const at::Tensor& logits, const ChunkStep& step, const at::Tensor& d) {
        Params p = row_params(logits, teacher.of(step), step, call);
        p.row = step.rows_in(row);
        p.row_term = step.rows_in(term);
        p.grad = step.rows_in(g);
        p.grads = d.data_ptr();
        p.grads_stride = d.stride(0);
        Kernels::grad_rows(p, acc, d.scalar_type());
      },
      teacher.copies_rows());
}

}  // namespace fused_rl_ops::vocab_divergence
