// The vocab-chunk loop of chosen_logprob, written once for every device. A device's Kernels supply
// the GEMMs and the hand-written row kernels (each of these runs one Params of
// chosen_logprob/params.h whose buffers are in the accumulation dtype acc, but for grads):
//   gemm_operand(t, acc)                 t as the GEMMs take it (CPU: converted to acc dtype)
//   grad_dtype(dtype)                    the dtype the gradient GEMMs take the logit gradients in,
//                                        for inputs of dtype (CPU: acc; CUDA: dtype itself)
//   logits(h, w, out)                    out = h w^T, accumulated and stored in acc dtype
//   stats_rows(params, acc)              merge a chunk into the row stats
//   top_rows(params, acc)                give a chunk to the rows' tops (sampler's filter)
//   top_ids_rows(params, acc)            give a chunk to the rows' tops with ids (top_logprobs)
//   hist_rows(params, acc)               add a chunk to the rows' search histograms (top_p)
//   grad_rows(params, acc, grads)        logits -> d(loss)/d(logits), into params.grads in dtype grads
//   add_mm(out, a, b)                    out += a b, out in acc dtype
//   mm(out, a, b)                        out = a b, accumulated in acc dtype, stored in out's dtype
//   kPieceRows                           0: each chunk's GEMMs take whole row blocks, in order, and
//                                        its row kernels all rows after them (CUDA); > 0: the rows are
//                                        cut into pieces of at most that many, run by
//   for_each_piece(count, fn)            fn(i) for each piece i, on threads as they come free (CPU;
//                                        see RowPieces)
//   fuses_main_grad                      whether the weight-gradient GEMMs add into an acc-dtype
//                                        main_grad themselves (CUDA), or hand over a gradient in
//                                        weight's dtype that is added (CPU)
// One workspace of logits (and in the backward one of logit gradients) lives at a time; a fused
// tensor-core kernel can replace this loop without touching the Python API. The loop reads the
// Tiling options (common/vocab_parallel.h); the row kernels get the logit map and the shard.
#pragma once

#include <ATen/ATen.h>

#include "chosen_logprob/math.h"
#include "chosen_logprob/params.h"
#include "chosen_logprob/sampler_filter.h"
#include "chosen_logprob/top_ids.h"
#include "common/torch_utils.h"

namespace fused_rl_ops::chosen_logprob {

// The backward's per-position inputs, [N] each in the accumulation dtype: the global row max, the
// log-sum relative to it (lse - row_max) and the log-sum minus the entropy, and the upstream
// gradients of logprob ([N, k]: one per token) and entropy; and the thresholds of the sampler's
// filter (undefined: none).
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
// group and [c0, c0 + n) of a chunk in it (on_group: the whole group, c0 = g0 and n = k); for
// on_chunk, the pass's rows [begin, end) its row kernels take (all of them, or one piece).
struct ChunkStep {
  int64_t r0, rows, g0, k, c0, n, begin, end;

  // on_chunk's rows of t ([N, ...] per token row)
  at::Tensor rows_of(const at::Tensor& t) const { return t.narrow(0, r0 + begin, end - begin); }
};

// How a pass's padded rows are cut for a device whose Kernels run pieces (kPieceRows > 0, the CPU):
// each block of the tiling into pieces of `piece` rows (the last of a block shorter where piece does
// not divide it: never in batch-invariant tilings, whose GEMMs so keep one shape), each piece's
// GEMMs and row kernels one task. Tasks handed to threads as they come free mean few parallel
// regions, each ending when the last piece does: a thread slowed by another process on its core
// takes fewer pieces instead of holding the others at a barrier with half the work (as GEMMs and
// row kernels split evenly between the threads do, one region each). For other Kernels (CUDA) a
// piece is a whole block.
struct RowPieces {
  int64_t block, piece, per_block, count;

  RowPieces(const RowTiling& tiling, int64_t padded_rows, int64_t piece_rows)
      : block(tiling.block), piece(piece_rows > 0 ? std::min(piece_rows, tiling.block) : tiling.block) {
    per_block = (block + piece - 1) / piece;
    count = padded_rows / block * per_block;
  }
  int64_t block_begin(int64_t i) const { return i / per_block * block; }
  int64_t begin(int64_t i) const { return block_begin(i) + i % per_block * piece; }
  int64_t end(int64_t i) const { return std::min(begin(i) + piece, block_begin(i) + block); }
};

// fn(i) for each i in [0, count): with Kernels::for_each_piece where the Kernels run pieces, else in
// order on this thread.
template <class Kernels, class Fn>
void for_each_piece(int64_t count, const Fn& fn) {
  if constexpr (Kernels::kPieceRows > 0) {
    Kernels::for_each_piece(count, fn);
  } else {
    for (int64_t i = 0; i < count; ++i) fn(i);
  }
}

// For each group of weight's rows (vocab.rows of them), each pass of token rows and each chunk of
// the group, nested in that order and in vocab order (so each token row meets the chunks in vocab
// order): on_chunk(logits, step), logits[:rows] = h[r0 : r0 + rows] w[c0 : c0 + n]^T, [rows, n] in
// the accumulation dtype (then the padding of a last block, up to a multiple of the block), in one
// workspace reused by every chunk and pass, for the rows [step.begin, step.end) of the pass (once
// for all rows, or once per piece, RowPieces, right after the piece's GEMM); then on_group(w_group,
// logits, step), after the group's chunks, with w_group its rows of weight as the GEMMs take them
// and logits the pass's logits of its last chunk.
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
  at::Tensor logits;
  for (int64_t g0 = 0; g0 < vocab.rows; g0 += vocab.group) {
    const int64_t k = std::min(vocab.group, vocab.rows - g0);
    const at::Tensor w_group = Kernels::gemm_operand(w.narrow(0, g0, k), acc);
    for (int64_t r0 = 0; r0 < N; r0 += tiling.pass) {
      const int64_t rows = std::min(tiling.pass, N - r0);
      const RowPieces pieces(tiling, tiling.padded(rows), Kernels::kPieceRows);
      for (int64_t c0 = g0; c0 < g0 + k; c0 += vocab.chunk) {
        const int64_t n = std::min(vocab.chunk, g0 + k - c0);
        logits = workspace.narrow(0, 0, tiling.padded(rows) * n).view({-1, n});
        const at::Tensor w_chunk = w_group.narrow(0, c0 - g0, n);
        const auto gemm = [&](int64_t i) {
          const int64_t b = pieces.begin(i), b0 = pieces.block_begin(i);
          at::Tensor out = logits.narrow(0, b, pieces.end(i) - b);
          Kernels::logits(block_rows(h, h_tail, tiling, r0 + b0).narrow(0, b - b0, out.size(0)), w_chunk, out);
        };
        if constexpr (Kernels::kPieceRows > 0) {
          Kernels::for_each_piece(pieces.count, [&](int64_t i) {
            gemm(i);
            const int64_t end = std::min(pieces.end(i), rows);  // no row kernel on a last block's padding
            if (pieces.begin(i) < end) on_chunk(logits, ChunkStep{r0, rows, g0, k, c0, n, pieces.begin(i), end});
          });
        } else {
          for (int64_t i = 0; i < pieces.count; ++i) gemm(i);
          on_chunk(logits, ChunkStep{r0, rows, g0, k, c0, n, 0, rows});
        }
      }
      on_group(w_group, logits, ChunkStep{r0, rows, g0, k, g0, k, 0, rows});
    }
  }
}

// The Params of a row kernel over on_chunk's rows (step.begin to step.end of the pass's logits, the
// chunk's), whose column 0 is vocabulary row step.c0 of this shard; tokens (undefined: none) are the
// rows' [N, k] ids.
inline Params row_params(const at::Tensor& logits, const ChunkStep& step, const at::Tensor& tokens,
                         const LogitMap& logit_map, const VocabShard& shard) {
  Params p;
  p.logits = logits.narrow(0, step.begin, step.end - step.begin).const_data_ptr();
  p.tokens_per_row = tokens.defined() ? tokens.size(1) : 0;
  if (tokens.defined()) p.tokens = step.rows_of(tokens).const_data_ptr<int64_t>();
  p.rows = step.end - step.begin;
  p.cols = logits.size(1);
  p.col0 = shard.vocab_start + step.c0;
  p.logit_map = logit_map;
  p.shard = shard;
  return p;
}

// Each row's k largest logits and their global ids (chosen_logprob/top_ids.h): values [N, k] in the
// accumulation dtype and ids [N, k] int64, starting as placeholders.
struct TopIds {
  at::Tensor values, ids;

  TopIds(int64_t N, int64_t k, const at::TensorOptions& acc_options)
      : values(at::full({N, k}, -INFINITY, acc_options)), ids(at::full({N, k}, kNoId, acc_options.dtype(at::kLong))) {}
};

// The per-position partials (stats_column in chosen_logprob/math.h) of this shard's logits, over
// the valid rows of weight (valid_rows; all without it) and, with a threshold, the logits at or
// above it, with the chosen logits of tokens [N, k] (undefined: none, k = 0). With a top width,
// followed by each row's top of those logits (width wide, chosen_logprob/sampler_filter.h). With
// top_ids, the rows' top logits with their ids given to it. The row kernels take raw logits and
// apply the logit map themselves.
template <class Kernels>
at::Tensor stats_impl(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& tokens,
                      const std::optional<at::Tensor>& threshold, const LogitMap& logit_map, const VocabShard& shard,
                      const Tiling& tiling_options, int64_t width, TopIds* top_ids = nullptr) {
  const auto acc = acc_dtype(hidden.scalar_type());
  const int64_t N = hidden.size(0), V = shard.valid_rows.value_or(weight.size(0));
  const int64_t k = tokens.defined() ? tokens.size(1) : 0;
  at::Tensor stats = at::zeros({N, stats_column::chosen + k}, hidden.options().dtype(acc));
  stats.select(1, stats_column::max).fill_(-INFINITY);
  at::Tensor tops = width > 0 ? at::zeros({N, top_column::values + width}, stats.options()) : at::Tensor();
  const auto result = [&] { return width > 0 ? at::cat({stats, tops}, 1) : stats; };
  if (N == 0 || V == 0) return result();
  const at::Tensor tok = tokens.defined() ? tokens.contiguous() : tokens;
  const at::Tensor tau = threshold ? threshold->contiguous() : at::Tensor();
  const RowTiling tiling(N, tiling_options.row_block, tiling_options.pass_rows);
  for_each_logits_chunk<Kernels>(
      aligned_rows(Kernels::gemm_operand(hidden.contiguous(), acc), tiling), weight.narrow(0, 0, V),
      VocabTiling(V, tiling_options.chunk_size, 1), tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        Params p = row_params(logits, step, tok, logit_map, shard);
        p.stats = step.rows_of(stats).mutable_data_ptr();
        if (tau.defined()) p.threshold = step.rows_of(tau).const_data_ptr();
        Kernels::stats_rows(p, acc);
        if (width > 0) {
          p.top = step.rows_of(tops).mutable_data_ptr();
          p.top_width = width;
          Kernels::top_rows(p, acc);
        }
        if (top_ids) {
          p.top = step.rows_of(top_ids->values).mutable_data_ptr();
          p.top_ids = step.rows_of(top_ids->ids).mutable_data_ptr<int64_t>();
          p.top_width = top_ids->values.size(1);
          Kernels::top_ids_rows(p, acc);
        }
      },
      [](const at::Tensor&, const at::Tensor&, const ChunkStep&) {});
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
        Params p = row_params(logits, step, at::Tensor(), logit_map, shard);
        p.row_max = step.rows_of(m).const_data_ptr();
        p.window = step.rows_of(windows).const_data_ptr();
        p.hist = step.rows_of(hist).mutable_data_ptr();
        Kernels::hist_rows(p, acc);
        if (top) {
          p.top = step.rows_of(*top).mutable_data_ptr();
          p.top_width = top->size(1) - top_column::values;
          Kernels::top_rows(p, acc);
        }
      },
      [](const at::Tensor&, const at::Tensor&, const ChunkStep&) {});
}

// The backward's chunk loop of every vocab-parallel op: the gradients of this shard, whose first
// valid_rows rows of weight are vocabulary (the rest padding), from the logit gradients that
// write_grads(logits, step, d) writes for on_chunk's rows [step.begin, step.end) of each chunk
// (logits: the pass's raw logits of the chunk, [padded rows, n] in the accumulation dtype; d: where
// those rows' gradients go, [end - begin, n] in the dtype the gradient GEMMs take, rows d.stride(0)
// apart; it may be logits' own rows; with Kernels that run pieces, called concurrently for disjoint
// rows): the hidden gradient (in the accumulation dtype, a partial sum over this shard's vocabulary)
// and the weight gradient (in weight's dtype, one [V, H] tensor whose padded rows alone are zeroed).
// With main_grad ([V, H], Megatron's gradient-accumulation buffer) the weight gradient goes into
// main_grad's rows instead, and the returned weight gradient is empty [0, H]: where
// Kernels::fuses_main_grad and main_grad is in the accumulation dtype, the weight-gradient GEMMs add
// into it themselves (Megatron's gradient_accumulation_fusion: no rounding to weight's dtype on the
// way); else each group's weight gradient, in weight's dtype as an unfused backward hands it over,
// is added through a [group, H] buffer.
// The logit gradients of each chunk are written in the dtype the gradient GEMMs take: over
// the logits in place when that is the accumulation dtype and a gradient GEMM takes one chunk
// (grad_chunks = 1); else into a buffer of a group's grad_chunks chunks, [pass, group], so that
// each gradient GEMM takes the whole group (K = group rows). The hidden gradient takes one GEMM per
// row block (row piece on the CPU) and group, summed over groups in vocab order. The weight gradient
// takes one GEMM per group over all rows (K = N) when they take one pass, or when they take several
// and that buffer, made [N, group] to hold every pass's gradients, is no larger than the [group, H]
// accumulator it spares; else one per group and pass, summed over passes in order in the
// accumulation dtype (on the CPU each by pieces of the group's rows).
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
  for_each_logits_chunk<Kernels>(
      h, weight.narrow(0, 0, valid_rows), vocab, tiling,
      [&](const at::Tensor& logits, const ChunkStep& step) {
        const at::Tensor d_chunk = grads_of(logits, step).narrow(0, step.begin, step.end - step.begin);
        write_grads(logits, step, d_chunk.narrow(1, step.c0 - step.g0, step.n));
      },
      [&](const at::Tensor& w_group, const at::Tensor& logits, const ChunkStep& step) {
        // The hidden gradient's GEMMs by row pieces (blocks on CUDA) and the weight gradient's by
        // pieces of the group's rows (all of them on CUDA, and where the GEMM rounds into weight's
        // dtype through a temporary: one [group, H] as chunk_loop_bytes counts), one task each.
        const at::Tensor d = grads_of(logits, step);
        const RowPieces row_pieces(tiling, tiling.padded(step.rows), Kernels::kPieceRows);
        const bool last_pass = step.r0 + step.rows >= N;
        // The weight-gradient GEMMs' rows: every row (once per group, after the last pass), or this pass's.
        const bool dw_now = !every_row_held || last_pass;
        const at::Tensor d_all = every_row_held ? held_rows(step).narrow(0, 0, N) : d.narrow(0, 0, step.rows);
        const at::Tensor h_rows = every_row_held ? h.narrow(0, 0, N) : h.narrow(0, step.r0, step.rows);
        const int64_t vocab_piece = Kernels::kPieceRows > 0 && !rounded ? Kernels::kPieceRows : step.k;
        const int64_t vocab_pieces = dw_now ? (step.k + vocab_piece - 1) / vocab_piece : 0;
        for_each_piece<Kernels>(row_pieces.count + vocab_pieces, [&](int64_t i) {
          if (i < row_pieces.count) {
            // The padding rows of a last block (of d: the logits of zero rows, or unwritten) reach
            // only grad_h_tail's padding.
            const int64_t b = row_pieces.begin(i), b0 = row_pieces.block_begin(i), rows = row_pieces.end(i) - b;
            at::Tensor out = block_rows(grad_h, grad_h_tail, tiling, step.r0 + b0).narrow(0, b - b0, rows);
            Kernels::add_mm(out, d.narrow(0, b, rows), w_group);
            return;
          }
          const int64_t v0 = (i - row_pieces.count) * vocab_piece, n = std::min(vocab_piece, step.k - v0);
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
            if (!last_pass) return;
            grad_w_rows.copy_(summed);
          }
          if (main_grad) main_grad->narrow(0, step.g0 + v0, n).add_(grad_w_rows);
        });
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
  // Several tokens per position: the rows' chosen-column gradients, taken before the logits are
  // overwritten (Params::entry_grads, CUDA; [pass, 1 + k], independent of the vocabulary).
  const int64_t k = tok.size(1), pass = RowTiling(hidden.size(0), tiling_options.row_block, tiling_options.pass_rows).pass;
  const at::Tensor entry_grads = k > 1 ? at::empty({pass * (1 + k)}, hidden.options().dtype(acc)) : at::Tensor();
  return gradient_loop<Kernels>(
      hidden, weight, shard.valid_rows.value_or(weight.size(0)), main_grad, tiling_options,
      [&](const at::Tensor& logits, const ChunkStep& step, const at::Tensor& d) {
        Params p = row_params(logits, step, tok, logit_map, shard);
        const auto row_ptr = [&](const at::Tensor& t) { return step.rows_of(t).const_data_ptr(); };
        p.row_max = row_ptr(row_max);
        p.log_sum = row_ptr(log_sum);
        p.log_sum_minus_entropy = row_ptr(log_sum_minus_entropy);
        p.grad_logprob = row_ptr(gl);
        p.grad_entropy = row_ptr(ge);
        if (tau.defined()) p.threshold = row_ptr(tau);
        if (entry_grads.defined()) p.entry_grads = entry_grads.mutable_data_ptr();
        p.grads = d.data_ptr();
        p.grads_stride = d.stride(0);
        Kernels::grad_rows(p, acc, d.scalar_type());
      });
}

}  // namespace fused_rl_ops::chosen_logprob
