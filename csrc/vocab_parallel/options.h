// The option groups every op over a vocab-parallel shard takes after its logit map, declared once
// each (how: common/options.h) and documented with their Python declarations, VocabShard and Tiling:
//   FRL_VOCAB_SHARD: which rows of the vocabulary the shard's weight [V, H] holds (vocab_start: the
//     global id of row 0; valid_rows: its first rows that are vocabulary, the rest padding);
//   FRL_TILING: how the chunk loop walks the rows (no row kernel reads it).
// Free of torch and CUDA headers.
#pragma once

#include <cstdint>
#include <optional>

#include "common/options.h"
#include "vocab_parallel/logit_map.h"

#define FRL_VOCAB_SHARD(X)                                  \
  X(int64_t, vocab_start, "int", "", NonNegativeInteger) \
  X(std::optional<int64_t>, valid_rows, "int?", "", NonNegativeInteger)

#define FRL_TILING(X)                                        \
  X(int64_t, chunk_size, "int", "", PositiveInteger)        \
  X(int64_t, row_block, "int", "=0", NonNegativeInteger)    \
  X(int64_t, pass_rows, "int", "=0", NonNegativeInteger)    \
  X(int64_t, grad_chunks, "int", "=1", PositiveInteger)

namespace fused_rl_ops {

struct VocabShard {
  FRL_VOCAB_SHARD(FRL_OPTION_FIELD)
};

struct Tiling {
  FRL_TILING(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const VocabShard& options, const Fn& fn) {
  FRL_VOCAB_SHARD(FRL_OPTION_VISIT)
}

template <class Fn>
void visit_options(const Tiling& options, const Fn& fn) {
  FRL_TILING(FRL_OPTION_VISIT)
}

// The groups every vocab-parallel op takes first, as its entry (entry.h) makes them from its
// parameters of the options' names: VocabParallelOptions{FRL_VOCAB_PARALLEL_VALUES}.
struct VocabParallelOptions {
  LogitMap logit_map;
  VocabShard shard;
  Tiling tiling;
};

// Every option of those groups, in the schema's order: what every vocab-parallel op takes first.
#define FRL_VOCAB_PARALLEL_OPTIONS(X) FRL_LOGIT_MAP(X) FRL_VOCAB_SHARD(X) FRL_TILING(X)

#define FRL_VOCAB_PARALLEL_VALUES \
  {FRL_LOGIT_MAP(FRL_OPTION_VALUE)}, {FRL_VOCAB_SHARD(FRL_OPTION_VALUE)}, {FRL_TILING(FRL_OPTION_VALUE)}

template <class Fn>
void visit_options(const VocabParallelOptions& options, const Fn& fn) {
  visit_options(options.logit_map, fn);
  visit_options(options.shard, fn);
  visit_options(options.tiling, fn);
}

}  // namespace fused_rl_ops
