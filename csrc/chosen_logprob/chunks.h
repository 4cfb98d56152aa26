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
//                                        cut into pieces of at most that many, tasks run by
//   for_each_piece(count, fn)            fn(i) for each task i, on threads as they come free (CPU;
//                                        see LogitsChunks::as_tasks)
//   fuses_main_grad                      whether the weight-gradient GEMMs add into an acc-dtype
//                                        main_grad themselves (CUDA), or hand over a gradient in
//                                        weight's dtype that is added (CPU)
// One workspace of logits (two in the CPU's backward) and in the backward one of logit gradients
// live at a time; a fused tensor-core kernel can replace this loop without touching the Python API.
// The loop reads the Tiling options (common/vocab_parallel.h); the row kernels get the logit map and
// the shard.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "chosen_logprob/math.h"
#include "chosen_logprob/params.h"
#include "chosen_logprob/sampler_filter.h"
#include "chosen_logprob/top_ids.h"
#include "common/task_queue.h"
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
// group and [c0, c0 + n) of a chunk in it (GroupWork: the whole group, c0 = g0 and n = k); for
// on_chunk, the pass's rows [begin, end) its row kernels take (all of them, or one piece).
struct ChunkStep {
  int64_t r0, rows, g0, k, c0, n, begin, end;

  // on_chunk's rows of t ([N, ...] per token row)
  at::Tensor rows_of(const at::Tensor& t) const { return t.narrow(0, r0 + begin, end - begin); }
};

// How a pass's padded rows are cut for a device whose Kernels run pieces (kPieceRows > 0, the CPU):
// each block of the tiling into pieces of `piece` rows (the last of a block shorter where piece does
// not divide it: never in batch-invariant tilings, whose GEMMs so keep one shape), each piece's
// GEMMs and row kernels one task (LogitsChunks::as_tasks). For other Kernels (CUDA) a piece is a
// whole block.
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
  int64_t at(int64_t row) const { return row / block * per_block + row % block / piece; }  // the piece of a row
};

// Piece i's rows of logits ([padded rows, n] of a pass from token row r0) = its rows of h times
// w_chunk^T; h_tail: h's zero-padded last block (block_rows).
template <class Kernels>
void piece_logits(at::Tensor& logits, const at::Tensor& w_chunk, const at::Tensor& h, const at::Tensor& h_tail,
                  const RowTiling& tiling, const RowPieces& pieces, int64_t r0, int64_t i) {
  const int64_t b = pieces.begin(i), b0 = pieces.block_begin(i);
  at::Tensor out = logits.narrow(0, b, pieces.end(i) - b);
  Kernels::logits(block_rows(h, h_tail, tiling, r0 + b0).narrow(0, b - b0, out.size(0)), w_chunk, out);
}

// What a backward does with a group's logit gradients in each pass, after the group's last chunk
// (gradient_loop; a forward does nothing): rows(w_group, logits, step, b0, b, n), the hidden
// gradient's GEMM for the pass's rows [b, b + n) of the row block that starts at b0, once per row
// piece (a block on CUDA; on the CPU run by the piece's task of the group's last chunk); then
// tasks(step) weight-gradient tasks, task(logits, step, t) each, once every row of the pass has its
// gradients. step: the whole group (c0 = g0, n = k) in the pass; w_group: the group's rows of weight
// as the GEMMs take them; logits: the pass's logits of the group's last chunk. buffers: how many
// logits workspaces the CPU alternates between passes: 2 where the gradients stay in the logits, so
// that a pass's weight-gradient tasks run beside the next pass's logits GEMMs. groups_in_turn: on_chunk
// holds a copy per group of its own (vocab_divergence's teacher weight rows), so on the CPU a group's
// tasks start once the previous group's are done, as where weight's rows are copied: one copy at a time.
struct GroupWork {
  std::function<void(const at::Tensor&, const at::Tensor&, const ChunkStep&, int64_t, int64_t, int64_t)> rows;
  std::function<int64_t(const ChunkStep&)> tasks;
  std::function<void(const at::Tensor&, const ChunkStep&, int64_t)> task;
  int64_t buffers = 1;
  bool groups_in_turn = false;

  int64_t task_count(const ChunkStep& step) const { return tasks ? tasks(step) : 0; }
};

// The chunk loop's walk (for_each_logits_chunk): the logits GEMMs of each group, pass and chunk,
// on_chunk after them and the GroupWork after each group's pass; in order on this thread (in_order:
// CUDA, whose kernels queue on a stream) or as tasks of row pieces on the CPU's threads (as_tasks).
template <class Kernels>
class LogitsChunks {
 public:
  LogitsChunks(const at::Tensor& h, const at::Tensor& weight, const VocabTiling& vocab, const RowTiling& tiling,
               int64_t buffers)
      : h_(h), w_(weight.contiguous()), vocab_(vocab), tiling_(tiling), acc_(acc_dtype(h.scalar_type())),
        buffers_(buffers) {
    if (tiling.tail_rows() > 0) {
      h_tail_ = at::zeros({tiling.block, h.size(1)}, h.options());
      h_tail_.narrow(0, 0, tiling.tail_rows()).copy_(h.narrow(0, tiling.last_full_row(), tiling.tail_rows()));
    }
    workspace_ = at::empty({buffers, tiling.pass * vocab.chunk}, h.options().dtype(acc_));
  }

  template <class OnChunk>
  void in_order(const OnChunk& on_chunk, const GroupWork& group) const {
    for (int64_t g0 = 0; g0 < vocab_.rows; g0 += vocab_.group) {
      const int64_t k = std::min(vocab_.group, vocab_.rows - g0);
      const at::Tensor w_group = Kernels::gemm_operand(w_.narrow(0, g0, k), acc_);
      for (int64_t r0 = 0; r0 < h_.size(0); r0 += tiling_.pass) {
        const int64_t rows = std::min(tiling_.pass, h_.size(0) - r0);
        const RowPieces pieces(tiling_, tiling_.padded(rows), 0);
        at::Tensor logits;
        for (int64_t c0 = g0; c0 < g0 + k; c0 += vocab_.chunk) {
          const int64_t n = std::min(vocab_.chunk, g0 + k - c0);
          logits = logits_in(0, rows, n);
          for (int64_t i = 0; i < pieces.count; ++i) {
            piece_logits<Kernels>(logits, w_group.narrow(0, c0 - g0, n), h_, h_tail_, tiling_, pieces, r0, i);
          }
          on_chunk(logits, ChunkStep{r0, rows, g0, k, c0, n, 0, rows});
        }
        const ChunkStep whole{r0, rows, g0, k, g0, k, 0, rows};
        for (int64_t i = 0; group.rows && i < pieces.count; ++i) {
          group.rows(w_group, logits, whole, pieces.block_begin(i), pieces.begin(i), pieces.end(i) - pieces.begin(i));
        }
        for (int64_t t = 0; t < group.task_count(whole); ++t) group.task(logits, whole, t);
      }
    }
  }

  // The CPU's schedule: a task per row piece of each pass's chunk (its logits GEMM, on_chunk for its
  // rows and, after the group's last chunk, its rows' GroupWork), and the passes' weight-gradient
  // tasks, all in one TaskQueue region, in loop order. A piece's tasks follow each other (its rows'
  // sums over the vocabulary keep vocab order, and its rows of the workspace are its own); a pass's
  // weight-gradient tasks wait for all of its pieces, and are queued after the next pass's pieces
  // where the workspaces alternate. So a thread waits only where a piece it needs is still being
  // computed, not for every thread at the end of each chunk.
  template <class OnChunk>
  void as_tasks(const OnChunk& on_chunk, const GroupWork& group) const {
    const Schedule plan(*this, group);
    TaskQueue queue(plan.counters());
    queue.run(
        static_cast<int64_t>(plan.tasks.size()),
        [](int64_t count, const auto& fn) { Kernels::for_each_piece(count, fn); },
        [&](int64_t t) { run_task(plan, plan.tasks[t], queue, on_chunk, group); });
  }

 private:
  // A pass of a group (unit): its steps (one per chunk, a task per piece each) are numbered from
  // first_step, its group's from group_first_step; weight_tasks: its weight-gradient tasks.
  struct Unit {
    int64_t group, g0, k, r0, rows, chunks;
    RowPieces pieces;
    int64_t first_step, group_first_step, weight_tasks;

    ChunkStep whole() const { return ChunkStep{r0, rows, g0, k, g0, k, 0, rows}; }
  };
  // A group's weight rows as the GEMMs take them, made by the first of its tasks and released by the last.
  struct GroupRows {
    int64_t piece_tasks = 0;
    at::Tensor w;
    std::once_flag made;
    std::atomic<int64_t> finished{0};
  };
  // A piece's task (chunk >= 0: the chunk's number in the group, piece: its RowPieces index, order: its
  // place among the tasks of that piece index, drain: whether it first waits for every earlier step
  // of its workspace) or a weight-gradient task (chunk < 0, piece: the task's number).
  struct Task {
    int64_t unit, chunk, piece, order;
    bool drain;
  };
  // The tasks in queue order, with the counters they wait for: one per piece index (its tasks done),
  // per step (its pieces done), per unit (weight-gradient tasks done) and per group (pieces done).
  struct Schedule {
    std::vector<Unit> units;
    std::vector<int64_t> step_unit;
    mutable std::deque<GroupRows> groups;
    std::vector<Task> tasks;
    int64_t slots = 0;

    Schedule(const LogitsChunks& loop, const GroupWork& group);
    int64_t steps() const { return static_cast<int64_t>(step_unit.size()); }
    int64_t counters() const { return slots + steps() + units.size() + groups.size(); }
    int64_t step_done(int64_t step) const { return slots + step; }
    int64_t weight_done(int64_t unit) const { return slots + steps() + unit; }
    int64_t group_done(int64_t g) const { return slots + steps() + units.size() + g; }
    void wait_step(const TaskQueue& queue, int64_t step) const {
      queue.wait(step_done(step), units[step_unit[step]].pieces.count);
    }
  };

  // The logits of a pass of `rows` for a chunk n wide, in workspace buffer b: [padded rows, n].
  at::Tensor logits_in(int64_t b, int64_t rows, int64_t n) const {
    return workspace_[b].narrow(0, 0, tiling_.padded(rows) * n).view({-1, n});
  }

  template <class OnChunk>
  void run_task(const Schedule& plan, const Task& task, const TaskQueue& queue, const OnChunk& on_chunk,
                const GroupWork& group) const {
    const Unit& unit = plan.units[task.unit];
    const int64_t buffer = task.unit % buffers_;
    if (task.chunk < 0) {  // a weight-gradient task: after its group's pieces so far and the previous pass's tasks
      for (int64_t s = unit.group_first_step; s < unit.first_step + unit.chunks; ++s) plan.wait_step(queue, s);
      if (task.unit > 0) queue.wait(plan.weight_done(task.unit - 1), plan.units[task.unit - 1].weight_tasks);
      const int64_t last_c0 = unit.g0 + (unit.chunks - 1) * vocab_.chunk;
      group.task(logits_in(buffer, unit.rows, unit.g0 + unit.k - last_c0), unit.whole(), task.piece);
      queue.raise(plan.weight_done(task.unit));
      return;
    }
    queue.wait(task.piece, task.order);  // the piece's previous task
    if (task.unit >= buffers_) {  // its workspace read by an earlier pass's weight-gradient tasks
      queue.wait(plan.weight_done(task.unit - buffers_), plan.units[task.unit - buffers_].weight_tasks);
    }
    const int64_t step = unit.first_step + task.chunk;
    for (int64_t s = 0; task.drain && s < step; ++s) {
      if (plan.step_unit[s] % buffers_ == buffer) plan.wait_step(queue, s);
    }
    GroupRows& rows_of_group = plan.groups[unit.group];
    std::call_once(rows_of_group.made, [&] {
      // A copy (reduced-precision weights, or on_chunk's) only once the previous group's is released:
      // one at a time.
      if ((w_.scalar_type() != acc_ || group.groups_in_turn) && unit.group > 0) {
        queue.wait(plan.group_done(unit.group - 1), plan.groups[unit.group - 1].piece_tasks);
      }
      rows_of_group.w = Kernels::gemm_operand(w_.narrow(0, unit.g0, unit.k), acc_);
    });
    const RowPieces& pieces = unit.pieces;
    const int64_t i = task.piece, c0 = unit.g0 + task.chunk * vocab_.chunk;
    const int64_t n = std::min(vocab_.chunk, unit.g0 + unit.k - c0);
    at::Tensor logits = logits_in(buffer, unit.rows, n);
    piece_logits<Kernels>(logits, rows_of_group.w.narrow(0, c0 - unit.g0, n), h_, h_tail_, tiling_, pieces, unit.r0, i);
    const int64_t end = std::min(pieces.end(i), unit.rows);  // no row kernel on a last block's padding
    if (pieces.begin(i) < end) {
      on_chunk(logits, ChunkStep{unit.r0, unit.rows, unit.g0, unit.k, c0, n, pieces.begin(i), end});
    }
    if (task.chunk == unit.chunks - 1 && group.rows) {
      group.rows(rows_of_group.w, logits, unit.whole(), pieces.block_begin(i), pieces.begin(i),
                 pieces.end(i) - pieces.begin(i));
    }
    if (rows_of_group.finished.fetch_add(1) + 1 == plan.groups[unit.group].piece_tasks) rows_of_group.w = at::Tensor();
    queue.raise(task.piece);
    queue.raise(plan.step_done(step));
    queue.raise(plan.group_done(unit.group));
  }

  at::Tensor h_, h_tail_, w_, workspace_;
  VocabTiling vocab_;
  RowTiling tiling_;
  at::ScalarType acc_;
  int64_t buffers_;
};

template <class Kernels>
LogitsChunks<Kernels>::Schedule::Schedule(const LogitsChunks& loop, const GroupWork& group) {
  const VocabTiling& vocab = loop.vocab_;
  const RowTiling& tiling = loop.tiling_;
  for (int64_t g0 = 0; g0 < vocab.rows; g0 += vocab.group) {
    const int64_t k = std::min(vocab.group, vocab.rows - g0), chunks = (k + vocab.chunk - 1) / vocab.chunk;
    GroupRows& rows_of_group = groups.emplace_back();
    for (int64_t r0 = 0; r0 < loop.h_.size(0); r0 += tiling.pass) {
      const int64_t rows = std::min(tiling.pass, loop.h_.size(0) - r0);
      const RowPieces pieces(tiling, tiling.padded(rows), Kernels::kPieceRows);
      const int64_t group_index = static_cast<int64_t>(groups.size()) - 1;
      const int64_t first_step = steps(), group_first_step = r0 == 0 ? first_step : units.back().group_first_step;
      Unit unit{group_index, g0, k, r0, rows, chunks, pieces, first_step, group_first_step, 0};
      unit.weight_tasks = group.task_count(unit.whole());
      rows_of_group.piece_tasks += chunks * pieces.count;
      step_unit.insert(step_unit.end(), chunks, static_cast<int64_t>(units.size()));
      units.push_back(unit);
      slots = std::max(slots, pieces.count);
    }
  }
  // Each piece index's tasks in order, with the chunk width last written in each workspace: a step
  // that writes another width lays its rows out differently, so it first waits for every earlier
  // step of that workspace (only around the vocabulary's last, narrower chunk).
  std::vector<int64_t> order(slots, 0), width(loop.buffers_, -1);
  const auto queue_weight_tasks = [&](int64_t u) {
    for (int64_t t = 0; t < units[u].weight_tasks; ++t) tasks.push_back(Task{u, -1, t, 0, false});
  };
  const int64_t buffers = loop.buffers_;
  for (int64_t u = 0; u < static_cast<int64_t>(units.size()); ++u) {
    const Unit& unit = units[u];
    const int64_t b = u % buffers;
    for (int64_t c = 0; c < unit.chunks; ++c) {
      const int64_t n = std::min(vocab.chunk, unit.k - c * vocab.chunk);
      const bool drain = width[b] >= 0 && width[b] != n;
      width[b] = n;
      for (int64_t i = 0; i < unit.pieces.count; ++i) tasks.push_back(Task{u, c, i, order[i]++, drain});
    }
    if (u + 1 >= buffers) queue_weight_tasks(u + 1 - buffers);
  }
  for (int64_t u = std::max<int64_t>(0, units.size() + 1 - buffers); u < static_cast<int64_t>(units.size()); ++u) {
    queue_weight_tasks(u);
  }
}

// For each group of weight's rows (vocab.rows of them), each pass of token rows and each chunk of
// the group, nested in that order and in vocab order (so each token row meets the chunks in vocab
// order): on_chunk(logits, step), logits[:rows] = h[r0 : r0 + rows] w[c0 : c0 + n]^T, [rows, n] in
// the accumulation dtype (then the padding of a last block, up to a multiple of the block), in a
// workspace reused by every chunk and pass (group.buffers of them on the CPU, alternating by pass),
// for the rows [step.begin, step.end) of the pass (once for all rows, or once per piece, RowPieces,
// right after the piece's GEMM; pieces of different chunks may run at once, never two of the same
// rows); then the group's work (GroupWork) after the group's chunks of each pass.
template <class Kernels, class OnChunk>
void for_each_logits_chunk(const at::Tensor& h, const at::Tensor& weight, const VocabTiling& vocab,
                           const RowTiling& tiling, const OnChunk& on_chunk, const GroupWork& group = GroupWork()) {
  TORCH_INTERNAL_ASSERT(weight.size(0) == vocab.rows);
  if constexpr (Kernels::kPieceRows > 0) {
    LogitsChunks<Kernels>(h, weight, vocab, tiling, group.buffers).as_tasks(on_chunk, group);
  } else {
    LogitsChunks<Kernels>(h, weight, vocab, tiling, 1).in_order(on_chunk, group);
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
      });
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
      });
}

// The backward's chunk loop of every vocab-parallel op: the gradients of this shard, whose first
// valid_rows rows of weight are vocabulary (the rest padding), from the logit gradients that
// write_grads(logits, step, d) writes for on_chunk's rows [step.begin, step.end) of each chunk
// (logits: the pass's raw logits of the chunk, [padded rows, n] in the accumulation dtype; d: where
// those rows' gradients go, [end - begin, n] in the dtype the gradient GEMMs take, rows d.stride(0)
// apart; it may be logits' own rows; with Kernels that run pieces, called concurrently for disjoint
// rows; groups_in_turn as in GroupWork): the hidden gradient (in the accumulation dtype, a partial
// sum over this shard's vocabulary)
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
