// The vocab-chunk loop of every op over a vocab-parallel shard, written once for every device: the
// logits of one chunk of weight's rows at a time, never [N, V]. A device's Kernels supply the GEMMs
// (vocab_parallel/cpu_gemms.h, cuda_gemms.h) and the op's row kernels, which on_chunk calls:
//   gemm_operand(t, acc)        t as the GEMMs take it (CPU: converted to the accumulation dtype acc)
//   grad_dtype(dtype)           the dtype the gradient GEMMs take logit gradients in (CPU: acc; CUDA: dtype)
//   logits(h, w, out)           out = h w^T, accumulated and stored in acc
//   add_mm(out, a, b)           out += a b, out in acc
//   mm(out, a, b)               out = a b, accumulated in acc, stored in out's dtype
//   kPieceRows                  0: the GEMMs take whole row blocks in order, the row kernels all of a
//                               pass's rows (CUDA); > 0: pieces of that many rows, run as tasks (CPU)
//   for_each_piece(count, fn)   fn(i) for each task i, on threads as they come free (CPU)
//   fuses_main_grad             whether the weight-gradient GEMMs add into an acc main_grad themselves
// One logits workspace (two in the CPU's backward) lives at a time.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "common/torch_utils.h"
#include "vocab_parallel/options.h"
#include "vocab_parallel/task_queue.h"
#include "vocab_parallel/tiling.h"

namespace fused_rl_ops {

// What a backward does after each pass's last chunk of a group (gradient_loop; a forward: nothing):
// rows(w_group, logits, step, b0, b, n), the hidden gradient's GEMM for rows [b, b + n) of the block
// at b0, once per piece; then tasks(step) weight-gradient tasks, task(logits, step, t) each, once the
// pass's rows all have their gradients. buffers: logits workspaces alternated by pass (2 lets the
// CPU's weight-gradient tasks overlap the next pass's GEMMs). groups_in_turn: on_chunk copies a
// group's rows of its own (the teacher's), so that the CPU holds one group's copy at a time.
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

  // The CPU's schedule: a task per row piece of each pass's chunk, and the passes' weight-gradient
  // tasks, in one TaskQueue region in loop order. A task waits only for what it reads, never for
  // every thread at a chunk's end, where a thread its core shares with another process held them all.
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
    int64_t pass, first_step, group_first_step, weight_tasks;

    ChunkStep whole() const { return ChunkStep{r0, rows, g0, k, g0, k, 0, rows}; }
  };
  // A group's weight rows as the GEMMs take them (w; chunks: its chunks' rows), made by the first of
  // its tasks and released by the last.
  struct GroupRows {
    int64_t piece_tasks = 0;
    at::Tensor w;
    std::vector<at::Tensor> chunks;
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
  // A pass's logits in one workspace buffer (all: [padded rows, n]) and each piece's rows of them.
  struct PassLogits {
    int64_t buffer, rows, n;
    at::Tensor all;
    std::vector<at::Tensor> pieces;
  };
  // The tasks in queue order, with the counters they wait for: one per piece index (its tasks done),
  // per step (its pieces done), per unit (weight-gradient tasks done) and per group (pieces done).
  // The views the tasks' GEMMs take are made here, once per call: each pass's pieces of h
  // (h_pieces) and of the logits of each buffer and chunk width (logits).
  struct Schedule {
    std::vector<Unit> units;
    std::vector<int64_t> step_unit;
    mutable std::deque<GroupRows> groups;
    std::vector<Task> tasks;
    int64_t slots = 0;
    std::vector<std::vector<at::Tensor>> h_pieces;
    std::vector<PassLogits> logits;

    Schedule(const LogitsChunks& loop, const GroupWork& group);
    const PassLogits* logits_of(int64_t buffer, int64_t rows, int64_t n) const {
      for (const PassLogits& l : logits) {
        if (l.buffer == buffer && l.rows == rows && l.n == n) return &l;
      }
      return nullptr;
    }
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
      for (int64_t c0 = 0; c0 < unit.k; c0 += vocab_.chunk) {
        rows_of_group.chunks.push_back(rows_of_group.w.narrow(0, c0, std::min(vocab_.chunk, unit.k - c0)));
      }
    });
    const RowPieces& pieces = unit.pieces;
    const int64_t i = task.piece, c0 = unit.g0 + task.chunk * vocab_.chunk;
    const int64_t n = std::min(vocab_.chunk, unit.g0 + unit.k - c0);
    const PassLogits& logits = *plan.logits_of(buffer, unit.rows, n);
    at::Tensor out = logits.pieces[i];
    Kernels::logits(plan.h_pieces[unit.pass][i], rows_of_group.chunks[task.chunk], out);
    const int64_t end = std::min(pieces.end(i), unit.rows);  // no row kernel on a last block's padding
    if (pieces.begin(i) < end) {
      on_chunk(logits.all, ChunkStep{unit.r0, unit.rows, unit.g0, unit.k, c0, n, pieces.begin(i), end});
    }
    if (task.chunk == unit.chunks - 1 && group.rows) {
      group.rows(rows_of_group.w, logits.all, unit.whole(), pieces.block_begin(i), pieces.begin(i),
                 pieces.end(i) - pieces.begin(i));
    }
    if (rows_of_group.finished.fetch_add(1) + 1 == plan.groups[unit.group].piece_tasks) {
      rows_of_group.w = at::Tensor();
      rows_of_group.chunks.clear();
    }
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
      const int64_t group_index = static_cast<int64_t>(groups.size()) - 1, pass = r0 / tiling.pass;
      if (g0 == 0) {
        const auto block_at = [&](int64_t b0) { return block_rows(loop.h_, loop.h_tail_, tiling, r0 + b0); };
        h_pieces.push_back(piece_views(pieces, block_at));
      }
      const int64_t first_step = steps(), group_first_step = r0 == 0 ? first_step : units.back().group_first_step;
      Unit unit{group_index, g0, k, r0, rows, chunks, pieces, pass, first_step, group_first_step, 0};
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
  // Unit u's weight-gradient tasks, placed before tasks[at].
  const auto queue_weight_tasks = [&](int64_t u, size_t at) {
    std::vector<Task> weight;
    for (int64_t t = 0; t < units[u].weight_tasks; ++t) weight.push_back(Task{u, -1, t, 0, false});
    tasks.insert(tasks.begin() + at, weight.begin(), weight.end());
  };
  const int64_t buffers = loop.buffers_;
  for (int64_t u = 0; u < static_cast<int64_t>(units.size()); ++u) {
    const Unit& unit = units[u];
    const int64_t b = u % buffers;
    const size_t first = tasks.size();
    for (int64_t c = 0; c < unit.chunks; ++c) {
      const int64_t n = std::min(vocab.chunk, unit.k - c * vocab.chunk);
      if (!logits_of(b, unit.rows, n)) {
        const at::Tensor all = loop.logits_in(b, unit.rows, n);
        const auto block_at = [&](int64_t b0) { return all.narrow(0, b0, tiling.block); };
        logits.push_back(PassLogits{b, unit.rows, n, all, piece_views(unit.pieces, block_at)});
      }
      const bool drain = width[b] >= 0 && width[b] != n;
      width[b] = n;
      for (int64_t i = 0; i < unit.pieces.count; ++i) tasks.push_back(Task{u, c, i, order[i]++, drain});
    }
    // With two workspaces, the previous pass's weight-gradient tasks go halfway through this pass's
    // pieces: queued right before the next pass's pieces, which wait for them, one thread would sit
    // out the other's last weight task at every pass.
    if (u + 1 >= buffers) {
      queue_weight_tasks(u + 1 - buffers, buffers > 1 ? first + (tasks.size() - first) / 2 : tasks.size());
    }
  }
  for (int64_t u = std::max<int64_t>(0, units.size() + 1 - buffers); u < static_cast<int64_t>(units.size()); ++u) {
    queue_weight_tasks(u, tasks.size());
  }
}

// on_chunk(logits, step) for each group of weight's rows, pass of token rows and chunk, nested in
// that order, so that each token row meets the chunks in vocab order. logits: the pass's [padded
// rows, n] = h w_chunk^T in the accumulation dtype, in a reused workspace; step: the rows on_chunk
// takes (all, or a CPU piece; no two tasks on one row at once). Then the group's GroupWork.
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

// An op's Params (its launch record) for a row kernel over on_chunk's rows of a chunk's logits, rows
// step.begin to step.end of the pass, whose column 0 is the global id vocab_start + step.c0.
template <class Params>
Params chunk_params(const at::Tensor& logits, const ChunkStep& step, const LogitMap& logit_map,
                    const VocabShard& shard) {
  Params p;
  p.logits = step.pass_rows_in(logits);
  p.rows = step.end - step.begin;
  p.cols = logits.size(1);
  p.col0 = shard.vocab_start + step.c0;
  p.logit_map = logit_map;
  return p;
}

// for_each_logits_chunk over the first valid_rows rows of weight (the rest padding), one chunk at a
// time, the token rows of hidden tiled as the options say: every forward's walk.
template <class Kernels, class OnChunk>
void for_each_chunk(const at::Tensor& hidden, const at::Tensor& weight, int64_t valid_rows, const Tiling& options,
                    const OnChunk& on_chunk, const GroupWork& group = GroupWork()) {
  const RowTiling tiling(hidden.size(0), options.row_block, options.pass_rows);
  const at::Tensor h = Kernels::gemm_operand(hidden.contiguous(), acc_dtype(hidden.scalar_type()));
  for_each_logits_chunk<Kernels>(aligned_rows(h, tiling), weight.narrow(0, 0, valid_rows),
                                 VocabTiling(valid_rows, options.chunk_size, 1), tiling, on_chunk, group);
}

}  // namespace fused_rl_ops
