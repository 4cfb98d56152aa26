// The vocab-chunk loop of chosen_logprob, written once for every device. A device's Kernels supply
// the GEMMs and the hand-written row kernels (each of these runs one Params of
// chosen_logprob/params.h whose buffers are in the accumulation dtype acc, but for grads):
//   gemm_operand(t, acc)                 t as the GEMMs take it (CPU: converted to acc dtype)
//   grad_dtype(dtype)                    the dtype the gradient GEMMs take the logit gradients in,
//                                        for inputs of dtype (CPU: acc; CUDA: dtype itself)
//   logits(h, w, out)                    out = h w^T, accumulated and stored in acc dtype
//   stats_rows(params, acc)              merge a chunk into the row stats
//   top_rows(params, acc)                give a chunk to the rows' tops (sampler's filter)
//   hist_rows(params, acc)               add a chunk to the rows' search histograms (top_p)
//   grad_rows(params, acc, grads)        logits -> d(loss)/d(logits), into params.grads in dtype grads
//   add_mm(out, a, b)                    out += a b, out in acc dtype
//   mm(out, a, b)                        out = a b, accumulated in acc dtype, stored in out's dtype
// One workspace of logits (and in the backward one of logit gradients) lives at a time; a fused
// tensor-core kernel can replace this loop without touching the Python API. The loop reads the
// Tiling options (common/vocab_parallel.h); the row kernels get the logit map and the shard.
#pragma once

#include <ATen/ATen.h>

#include "chosen_logprob/math.h"
#include "chosen_logprob/params.h"
#include "chosen_logprob/sampler_filter.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::chosen_logprob {

// The backward's per-token inputs, [N] each in the accumulation dtype: the global row max, the
// log-sum relative to it (lse - row_max) and the log-sum minus the entropy, and the upstream
// gradients of logprob and entropy; and the thresholds of the sampler's filter (undefined: none).
struct TokenGrads {
  at::Tensor row_max, log_sum, log_sum_minus_entropy, grad_logprob, grad_entropy, threshold;
};

// How the token rows meet the GEMMs. Every GEMM takes exactly `block` rows (a last, shorter block
// runs on a zero-padded copy), and the rows are walked in passes of `pass` rows (a multiple of
// `block`) that share the logits workspace. With a block and chunk width fixed independently of
// the batch, every GEMM call has one shape, so each row's dot products are computed by the same
// kernel in the same order whatever the other rows are (batch invariance); the default, one block
// and one pass of all N rows, makes one GEMM per chunk.
struct RowTiling {
  int64_t N, block, pass;
  bool fixed_block;  // block was given (batch-invariant), not all rows

  RowTiling(int64_t num_rows, int64_t row_block, int64_t pass_rows) : N(num_rows), fixed_block(row_block > 0) {
    block = row_block > 0 ? row_block : std::max<int64_t>(N, 1);
    pass = pass_rows > 0 ? std::max(pass_rows / block, int64_t(1)) * block : block;
    pass = std::min(pass, padded(N));
  }
  int64_t padded(int64_t rows) const { return (rows + block - 1) / block * block; }
  int64_t tail_rows() const { return N % block; }  // rows of the padded last block (0: none)
  int64_t last_full_row() const { return N - tail_rows(); }
};

// t itself, or a copy where a fixed-block GEMM operand would start off the alignment its
// allocator gives (64 bytes on the CPU, 256 on CUDA, where torch tells cuBLASLt the operands'
// alignment up to 256): BLAS libraries may pick their kernel by alignment, and a token's rows must
// meet the same kernel in every call. Blocks are multiples of 128 rows, so they all start aligned.
inline at::Tensor aligned_rows(const at::Tensor& t, const RowTiling& tiling) {
  const uintptr_t alignment = t.is_cuda() ? 256 : 64;
  const bool misaligned = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % alignment != 0;
  return tiling.fixed_block && misaligned ? t.clone() : t;
}

// Rows [r0, r0 + block) of t as a GEMM operand: a view, or the zero-padded copy `tail` of the
// last block.
inline at::Tensor block_rows(const at::Tensor& t, const at::Tensor& tail, const RowTiling& tiling, int64_t r0) {
  return r0 < tiling.last_full_row() ? t.narrow(0, r0, tiling.block) : tail;
}

// How weight's rows meet the GEMMs: in chunks of `chunk` rows, one logits GEMM and one row kernel
// each, walked in groups of `group` rows (a whole number of chunks, or all rows) that the
// backward's gradient GEMMs take at once. Fixed by the options alone, so batch-invariant tilings
// keep one GEMM shape.
struct VocabTiling {
  int64_t rows, chunk, group;

  VocabTiling(int64_t vocab_rows, int64_t chunk_size, int64_t group_chunks)
      : rows(vocab_rows), chunk(std::min(chunk_size, vocab_rows)) {
    // chunk * group_chunks, or all rows when that is at least as many (without a product that overflows)
    group = chunk == 0 || group_chunks > (rows - 1) / chunk ? rows : chunk * group_chunks;
  }
};

// Where for_each_logits_chunk is: token rows [r0, r0 + rows) of a pass, vocab rows [g0, g0 + k) of a
// group and [c0, c0 + n) of a chunk in it (on_group: the whole group, c0 = g0 and n = k).
struct ChunkStep {
  int64_t r0, rows, g0, k, c0, n;
};

// For each group of weight's rows (vocab.rows of them), each pass of token rows and each chunk of
// the group, nested in that order and in vocab order (so each token row meets the chunks in vocab
// order): on_chunk(logits, step), logits[:rows] = h[r0 : r0 + rows] w[c0 : c0 + n]^T, [rows, n] in
// the accumulation dtype (then the padding of a last block, up to a multiple of the block), in one
// workspace reused by every chunk and pass; then on_group(w_group, step), after the group's chunks,
// with w_group its rows of weight as the GEMMs take them.
template <class Kernels, class OnChunk, class OnGroup>
void for_each_logits_chunk(const at::Tensor& h, const at::Tensor& weight, const VocabTiling& vocab,
                           const RowTiling& tiling, const OnChunk& on_chunk, const OnGroup& on_group) {
  TORCH_INTERNAL_ASSERT(weight.size(0) == vocab.rows);
  const int64_t N = h.size(0);
  const auto acc = acc_dtype(h.scalar_type());
  const at::Tensor w = weight.contiguous();
  at::Tensor h_tail;
  if (tiling.tail_rows() > 0) {
    h_tail = at::zeros({tiling.block, h.size(1)}, h.options());
    h_tail.narrow(0, 0, tiling.tail_rows()).copy_(h.narrow(0, tiling.last_full_row(), tiling.tail_rows()));
  }
  at::Tensor workspace = at::empty({tiling.pass * vocab.chunk}, h.options().dtype(acc));
  for (int64_t g0 = 0; g0 < vocab.rows; g0 += vocab.group) {
    const int64_t k = std::min(vocab.group, vocab.rows - g0);
    const at::Tensor w_group = Kernels::gemm_operand(w.narrow(0, g0, k), acc);
    for (int64_t r0 = 0; r0 < N; r0 += tiling.pass) {
      const int64_t rows = std::min(tiling.pass, N - r0);
      for (int64_t c0 = g0; c0 < g0 + k; c0 += vocab.chunk) {
        const int64_t n = std::min(vocab.chunk, g0 + k - c0);
        at::Tensor logits = workspace.narrow(0, 0, tiling.padded(rows) * n).view({-1, n});
        const at::Tensor w_chunk = w_group.narrow(0, c0 - g0, n);
        for (int64_t b0 = 0; b0 < rows; b0 += tiling.block) {
          at::Tensor out = logits.narrow(0, b0, tiling.block);
          Kernels::logits(block_rows(h, h_tail, tiling, r0 + b0), w_chunk, out);
        }
        on_chunk(logits, ChunkStep{r0, rows, g0, k, c0, n});
      }
      on_group(w_group, ChunkStep{r0, rows, g0, k, g0, k});
    }
  }
}

// The Params of a row kernel over rows [r0, r0 + rows) of one chunk's logits (the workspace's
// first `rows` rows), whose column 0 is vocabulary row c0 of this shard; tokens (undefined: none)
// are the rows' [N] ids.
inline Params row_params(const at::Tensor& logits, int64_t rows, const at::Tensor& tokens, const LogitMap& logit_map,
                         const VocabShard& shard, int64_t c0, int64_t r0) {
  Params p;
  p.logits = logits.const_data_ptr();
  if (tokens.defined()) p.tokens = tokens.const_data_ptr<int64_t>() + r0;
  p.rows = rows;
  p.cols = logits.size(1);
  p.col0 = shard.vocab_start + c0;
  p.logit_map = logit_map;
  p.shard = shard;
  return p;
}

// The per-token partials (stats_column in chosen_logprob/math.h) of this shard's logits, over the
// valid rows of weight (valid_rows; all without it) and, with a threshold, the logits at or above
// it. With a top width, followed by each row's top of those logits (width wide,
// chosen_logprob/sampler_filter.h). The row kernels take raw logits and apply the logit map
// themselves.
template <class Kernels>
at::Tensor stats_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                      const std::optional<at::Tensor>& threshold, const LogitMap& logit_map, const VocabShard& shard,
                      const Tiling& tiling_options, int64_t width) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = shard.valid_rows.value_or(weight.size(0));
  at::Tensor stats = at::zeros({N, stats_column::count}, hidden.options().dtype(acc));
  stats.select(1, stats_column::max).fill_(-INFINITY);
  at::Tensor tops = width > 0 ? at::zeros({N, top_column::values + width}, stats.options()) : at::Tensor();
  const auto result = [&] { return width > 0 ? at::cat({stats, tops}, 1) : stats; };
  if (N == 0 || V == 0) return result();
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor tau = threshold ? threshold->contiguous() : at::Tensor();
  const RowTiling tiling(N, tiling_options.row_block, tiling_options.pass_rows);
  for_each_logits_chunk<Kernels>(
      aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling), weight.narrow(0, 0, V),
      VocabTiling(V, tiling_options.chunk_size, 1), tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        Params p = row_params(logits, step.rows, tok, logit_map, shard, step.c0, step.r0);
        p.stats = stats.narrow(0, step.r0, step.rows).mutable_data_ptr();
        if (tau.defined()) p.threshold = tau.narrow(0, step.r0, step.rows).const_data_ptr();
        Kernels::stats_rows(p, acc);
        if (width > 0) {
          p.top = tops.narrow(0, step.r0, step.rows).mutable_data_ptr();
          p.top_width = width;
          Kernels::top_rows(p, acc);
        }
      },
      [](const at::Tensor&, const ChunkStep&) {});
  return result();
}

// One round of the top_p search over this shard's logits (valid rows of weight): for each row with
// a window (window [N, 2] double, SearchWindow), the mass of its logits in the window's cells,
// relative to row_max, added to hist [N, kSearchBins] int64; with top, those logits given to
// it ([N, top_column::values + K]).
template <class Kernels>
void search_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& row_max,
                 const at::Tensor& window, at::Tensor& hist, const std::optional<at::Tensor>& top,
                 const LogitMap& logit_map, const VocabShard& shard, const Tiling& tiling_options) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = shard.valid_rows.value_or(weight.size(0));
  if (N == 0 || V == 0) return;
  const at::Tensor m = row_max.contiguous(), windows = window.contiguous();
  const RowTiling tiling(N, tiling_options.row_block, tiling_options.pass_rows);
  for_each_logits_chunk<Kernels>(
      aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling), weight.narrow(0, 0, V),
      VocabTiling(V, tiling_options.chunk_size, 1), tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        Params p = row_params(logits, step.rows, at::Tensor(), logit_map, shard, step.c0, step.r0);
        p.row_max = m.narrow(0, step.r0, step.rows).const_data_ptr();
        p.window = windows.narrow(0, step.r0, step.rows).const_data_ptr();
        p.hist = hist.narrow(0, step.r0, step.rows).mutable_data_ptr();
        Kernels::hist_rows(p, acc);
        if (top) {
          p.top = top->narrow(0, step.r0, step.rows).mutable_data_ptr();
          p.top_width = top->size(1) - top_column::values;
          Kernels::top_rows(p, acc);
        }
      },
      [](const at::Tensor&, const ChunkStep&) {});
}

// The backward's chunk loop of every vocab-parallel op: the gradients of this shard, whose first
// valid_rows rows of weight are vocabulary (the rest padding), from the logit gradients that
// write_grads(logits, step, d) writes for each chunk (logits: its raw logits, [padded rows, n] in the
// accumulation dtype; d: where the gradients go, [rows, n] in the dtype the gradient GEMMs take,
// rows d.stride(0) apart; it may be logits itself): the hidden gradient (in the accumulation dtype,
// a partial sum over this shard's vocabulary) and the weight gradient (in weight's dtype, one
// [V, H] tensor whose padded rows alone are zeroed). With main_grad ([V, H], Megatron's
// gradient-accumulation buffer) each group's weight gradient, in weight's dtype as an unfused
// backward hands it over, is added into main_grad's rows instead, through a [group, H] buffer, and
// the returned weight gradient is empty [0, H].
// The logit gradients go over the logits in place when the GEMMs take the accumulation dtype and a
// gradient GEMM takes one chunk (grad_chunks = 1); else into a buffer of a group's grad_chunks
// chunks, [pass, group], so that each gradient GEMM takes the whole group (K = group rows). The
// hidden gradient takes one GEMM per row block and group, summed over groups in vocab order; the
// weight gradient one per group and pass, summed over passes in order in the accumulation dtype.
template <class Kernels, class WriteGrads>
std::tuple<at::Tensor, at::Tensor> gradient_loop(const at::Tensor& hidden, const at::Tensor& weight, int64_t valid_rows,
                                                 const std::optional<at::Tensor>& main_grad,
                                                 const Tiling& tiling_options, const WriteGrads& write_grads) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = weight.size(0), H = weight.size(1);
  at::Tensor grad_h = at::zeros({N, H}, hidden.options().dtype(acc));
  at::Tensor grad_w = main_grad ? at::empty({0, H}, weight.options()) : at::empty(weight.sizes(), weight.options());
  const bool any_chunk = N > 0 && valid_rows > 0;
  if (!main_grad) grad_w.narrow(0, any_chunk ? valid_rows : 0, any_chunk ? V - valid_rows : V).zero_();
  if (!any_chunk) return {grad_h, grad_w};
  const RowTiling tiling(N, tiling_options.row_block, tiling_options.pass_rows);
  const bool one_pass = tiling.pass >= N;
  const at::Tensor h = aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling);
  at::Tensor grad_h_tail = tiling.tail_rows() > 0 ? at::zeros({tiling.block, H}, grad_h.options()) : at::Tensor();
  const at::ScalarType grads_dtype = Kernels::grad_dtype(hidden.scalar_type());
  const bool in_place = grads_dtype == acc && tiling_options.grad_chunks == 1;
  const VocabTiling vocab(valid_rows, tiling_options.chunk_size, in_place ? 1 : tiling_options.grad_chunks);
  const at::Tensor grads =
      in_place ? at::Tensor() : at::empty({tiling.pass * vocab.group}, hidden.options().dtype(grads_dtype));
  // The weight group's gradient summed over passes (several passes only), one buffer for every group.
  const at::Tensor grad_w_acc = one_pass ? at::Tensor() : at::empty({vocab.group, H}, grad_h.options());
  const at::Tensor group_grad = main_grad ? at::empty({vocab.group, H}, weight.options()) : at::Tensor();
  at::Tensor d;  // the group's logit gradients in this pass, [padded rows, k]: the logits, or in grads
  for_each_logits_chunk<Kernels>(
      h, weight.narrow(0, 0, valid_rows), vocab, tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        d = in_place ? logits : grads.narrow(0, 0, tiling.padded(step.rows) * step.k).view({-1, step.k});
        write_grads(logits, step, d.narrow(1, step.c0 - step.g0, step.n));
      },
      [&](const at::Tensor& w_group, const ChunkStep& step) {
        // The padding rows of a last block (of d: the logits of zero rows, or unwritten) reach only
        // grad_h_tail's padding.
        for (int64_t b0 = 0; b0 < step.rows; b0 += tiling.block) {
          at::Tensor out = block_rows(grad_h, grad_h_tail, tiling, step.r0 + b0);
          Kernels::add_mm(out, d.narrow(0, b0, tiling.block), w_group);
        }
        at::Tensor grad_w_group = main_grad ? group_grad.narrow(0, 0, step.k) : grad_w.narrow(0, step.g0, step.k);
        const at::Tensor d_rows = d.narrow(0, 0, step.rows).t(), h_rows = h.narrow(0, step.r0, step.rows);
        if (one_pass) {
          Kernels::mm(grad_w_group, d_rows, h_rows);
        } else {
          at::Tensor summed = grad_w_acc.narrow(0, 0, step.k);
          if (step.r0 == 0) summed.zero_();
          Kernels::add_mm(summed, d_rows, h_rows);
          if (step.r0 + step.rows < N) return;
          grad_w_group.copy_(summed);
        }
        if (main_grad) main_grad->narrow(0, step.g0, step.k).add_(grad_w_group);
      });
  if (tiling.tail_rows() > 0) {
    grad_h.narrow(0, tiling.last_full_row(), tiling.tail_rows()).copy_(grad_h_tail.narrow(0, 0, tiling.tail_rows()));
  }
  return {grad_h, grad_w};
}

// Gradients of sum(grad_logprob * logprob + grad_entropy * entropy) for this shard (gradient_loop,
// with the valid rows of the shard).
template <class Kernels>
std::tuple<at::Tensor, at::Tensor> backward_impl(const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& tokens, const TokenGrads& token_grads,
                                                 const std::optional<at::Tensor>& main_grad, const LogitMap& logit_map,
                                                 const VocabShard& shard, const Tiling& tiling_options) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const at::Tensor tok = tokens.contiguous();
  const at::Tensor row_max = token_grads.row_max.contiguous(), log_sum = token_grads.log_sum.contiguous();
  const at::Tensor log_sum_minus_entropy = token_grads.log_sum_minus_entropy.contiguous();
  const at::Tensor gl = token_grads.grad_logprob.contiguous(), ge = token_grads.grad_entropy.contiguous();
  const at::Tensor tau = token_grads.threshold.defined() ? token_grads.threshold.contiguous() : at::Tensor();
  return gradient_loop<Kernels>(
      hidden, weight, shard.valid_rows.value_or(weight.size(0)), main_grad, tiling_options,
      [&](const at::Tensor& logits, const ChunkStep& step, const at::Tensor& d) {
        Params p = row_params(logits, step.rows, tok, logit_map, shard, step.c0, step.r0);
        const auto row_ptr = [&](const at::Tensor& t) { return t.narrow(0, step.r0, step.rows).const_data_ptr(); };
        p.row_max = row_ptr(row_max);
        p.log_sum = row_ptr(log_sum);
        p.log_sum_minus_entropy = row_ptr(log_sum_minus_entropy);
        p.grad_logprob = row_ptr(gl);
        p.grad_entropy = row_ptr(ge);
        if (tau.defined()) p.threshold = row_ptr(tau);
        p.grads = d.data_ptr();
        p.grads_stride = d.stride(0);
        Kernels::grad_rows(p, acc, d.scalar_type());
      });
}

}  // namespace fused_rl_ops::chosen_logprob
