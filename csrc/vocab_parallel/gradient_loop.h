// The backward's chunk loop of every op over a vocab-parallel shard: the hidden and weight
// gradients from the logit gradients the op's row kernel writes chunk by chunk, never [N, V].
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "vocab_parallel/chunk_loop.h"

namespace fused_rl_ops {

// The gradients of this shard, whose first valid_rows rows of weight are vocabulary: the hidden
// gradient (accumulation dtype, this shard's partial sum) and the weight gradient (weight's dtype,
// its padding rows zero), from the logit gradients write_grads(logits, step, d) writes for on_chunk's
// rows (d: [end - begin, n] in the gradient GEMMs' dtype, perhaps logits' own rows; on the CPU called
// at once for disjoint rows). With main_grad (Megatron's buffer) the weight gradient is added there,
// inside the GEMMs where the device can (no rounding on the way), and an empty [0, H] is returned.
// The logit gradients stay in the logits where one GEMM takes one chunk in the accumulation dtype,
// else a buffer holds a group's (grad_chunks chunks a GEMM: fewer, larger GEMMs). The weight gradient
// takes one GEMM per group over every row where the passes' gradients fit in no more memory than the
// [group, H] sum a GEMM per pass needs.
template <class Kernels, class WriteGrads>
std::tuple<at::Tensor, at::Tensor> gradient_loop(const at::Tensor& hidden, const at::Tensor& weight, int64_t valid_rows,
                                                 const std::optional<at::Tensor>& main_grad,
                                                 const Tiling& tiling_options, const WriteGrads& write_grads,
                                                 bool groups_in_turn = false) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = weight.size(0), H = weight.size(1);
  at::Tensor grad_h = at::zeros({N, H}, hidden.options().dtype(acc));
  at::Tensor grad_w = main_grad ? at::empty({0, H}, weight.options()) : at::empty(weight.sizes(), weight.options());
  const bool any_chunk = N > 0 && valid_rows > 0;
  if (!main_grad) grad_w.narrow(0, any_chunk ? valid_rows : 0, any_chunk ? V - valid_rows : V).zero_();
  if (!any_chunk) return {grad_h, grad_w};
  const RowTiling tiling(N, tiling_options.row_block, tiling_options.pass_rows);
  const at::Tensor h = aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling);
  at::Tensor grad_h_tail = tiling.tail_rows() > 0 ? at::zeros({tiling.block, H}, grad_h.options()) : at::Tensor();
  const at::ScalarType grads_dtype = Kernels::grad_dtype(hidden.scalar_type());
  const bool in_place = grads_dtype == acc && tiling_options.grad_chunks == 1;
  const VocabTiling vocab(valid_rows, tiling_options.chunk_size, in_place ? 1 : tiling_options.grad_chunks);
  // One weight-gradient GEMM per group (K = N), or one per group and pass into grad_w_acc.
  const bool one_pass = tiling.pass >= N;
  const auto size_of = [](at::ScalarType t) { return static_cast<int64_t>(at::elementSize(t)); };
  const bool every_row_held = !in_place && !one_pass &&
                              tiling.padded(N) * size_of(grads_dtype) <=
                                  tiling.pass * size_of(grads_dtype) + H * size_of(acc);
  const bool dw_per_group = one_pass || every_row_held;
  const bool fused_main_grad = main_grad && Kernels::fuses_main_grad && main_grad->scalar_type() == acc;
  const at::Tensor grads =
      in_place ? at::Tensor()
               : at::empty({(every_row_held ? tiling.padded(N) : tiling.pass) * vocab.group},
                           hidden.options().dtype(grads_dtype));
  const at::Tensor grad_w_acc =
      dw_per_group || fused_main_grad ? at::Tensor() : at::empty({vocab.group, H}, grad_h.options());
  const at::Tensor group_grad =
      main_grad && !fused_main_grad ? at::empty({vocab.group, H}, weight.options()) : at::Tensor();
  // The weight gradient's GEMMs round into weight's dtype (CPU, reduced-precision weights).
  const bool rounded = weight.scalar_type() != grads_dtype;
  // The group's logit gradients of every row, [padded N, k] (every_row_held).
  const auto held_rows = [&](const ChunkStep& step) {
    return grads.narrow(0, 0, tiling.padded(N) * step.k).view({-1, step.k});
  };
  // The group's logit gradients in this pass, [padded rows, k]: the logits (of its one chunk), or in grads.
  const auto grads_of = [&](const at::Tensor& logits, const ChunkStep& step) {
    if (in_place) return logits;
    if (every_row_held) return held_rows(step).narrow(0, step.r0, tiling.padded(step.rows));
    return grads.narrow(0, 0, tiling.padded(step.rows) * step.k).view({-1, step.k});
  };
  GroupWork group;
  group.groups_in_turn = groups_in_turn;
  // Where the gradients stay in the logits, the CPU's pieces compute a pass's logits in one workspace
  // while the weight-gradient GEMMs read the previous pass's gradients in the other.
  group.buffers = in_place ? 2 : 1;
  // The hidden gradient's GEMMs, by row pieces (blocks on CUDA): the padding rows of a last block (of
  // d: the logits of zero rows, or unwritten) reach only grad_h_tail's padding.
  group.rows = [&](const at::Tensor& w_group, const at::Tensor& logits, const ChunkStep& step, int64_t b0, int64_t b,
                   int64_t rows) {
    at::Tensor out = block_rows(grad_h, grad_h_tail, tiling, step.r0 + b0).narrow(0, b - b0, rows);
    Kernels::add_mm(out, grads_of(logits, step).narrow(0, b, rows), w_group);
  };
  // The weight gradient's GEMMs, by pieces of the group's rows (all of them on CUDA, and where the
  // GEMM rounds into weight's dtype through a temporary: one [group, H] as chunk_loop_bytes counts),
  // over every row once per group after its last pass (every_row_held) or over each pass's rows.
  const auto vocab_piece = [&](const ChunkStep& step) {
    return Kernels::kPieceRows > 0 && !rounded ? Kernels::kPieceRows : step.k;
  };
  const auto last_pass = [&](const ChunkStep& step) { return step.r0 + step.rows >= N; };
  group.tasks = [&](const ChunkStep& step) -> int64_t {
    return !every_row_held || last_pass(step) ? (step.k + vocab_piece(step) - 1) / vocab_piece(step) : 0;
  };
  group.task = [&](const at::Tensor& logits, const ChunkStep& step, int64_t t) {
    const at::Tensor d_all =
        every_row_held ? held_rows(step).narrow(0, 0, N) : grads_of(logits, step).narrow(0, 0, step.rows);
    const at::Tensor h_rows = every_row_held ? h.narrow(0, 0, N) : h.narrow(0, step.r0, step.rows);
    const int64_t v0 = t * vocab_piece(step), n = std::min(vocab_piece(step), step.k - v0);
    const at::Tensor d_rows = d_all.narrow(1, v0, n).t();
    if (fused_main_grad) {
      at::Tensor rows = main_grad->narrow(0, step.g0 + v0, n);
      Kernels::add_mm(rows, d_rows, h_rows);
      return;
    }
    at::Tensor grad_w_rows =
        (main_grad ? group_grad.narrow(0, 0, step.k) : grad_w.narrow(0, step.g0, step.k)).narrow(0, v0, n);
    if (dw_per_group) {
      Kernels::mm(grad_w_rows, d_rows, h_rows);
    } else {
      at::Tensor summed = grad_w_acc.narrow(0, v0, n);
      if (step.r0 == 0) summed.zero_();
      Kernels::add_mm(summed, d_rows, h_rows);
      if (!last_pass(step)) return;
      grad_w_rows.copy_(summed);
    }
    if (main_grad) main_grad->narrow(0, step.g0 + v0, n).add_(grad_w_rows);
  };
  for_each_logits_chunk<Kernels>(
      h, weight.narrow(0, 0, valid_rows), vocab, tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        const at::Tensor d_chunk = grads_of(logits, step).narrow(0, step.begin, step.end - step.begin);
        write_grads(logits, step, d_chunk.narrow(1, step.c0 - step.g0, step.n));
      },
      group);
  if (tiling.tail_rows() > 0) {
    grad_h.narrow(0, tiling.last_full_row(), tiling.tail_rows()).copy_(grad_h_tail.narrow(0, 0, tiling.tail_rows()));
  }
  return {grad_h, grad_w};
}

}  // namespace fused_rl_ops
