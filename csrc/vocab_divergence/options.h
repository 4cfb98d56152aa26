// vocab_divergence's own options, declared once (how: common/options.h). Its ops take the student's
// logit map, the teacher's (FRL_TEACHER_LOGIT_MAP, a LogitMap of its own), the shard and the tiling,
// then these. Python declares them as VocabDivergenceOptions, which documents them.
#pragma once

#include <cstdint>
#include <optional>

#include "vocab_parallel/options.h"

namespace fused_rl_ops {

// Which divergence: 0 forward_kl, 1 reverse_kl, 2 jsd (vocab_divergence::Kind).
struct DivergenceKind {
  static constexpr const char* requirement = "0 (forward_kl), 1 (reverse_kl) or 2 (jsd)";
  static bool holds(int64_t v) { return v >= 0 && v <= 2; }
};

struct OpenUnitInterval {  // NaN fails both comparisons
  static constexpr const char* requirement = "a number in (0, 1)";
  static bool holds(double v) { return v > 0 && v < 1; }
};

}  // namespace fused_rl_ops

#define FRL_VOCAB_DIVERGENCE_OPTIONS(X)         \
  X(int64_t, kind, "int", "=0", DivergenceKind) \
  X(double, beta, "float", "=0.5", OpenUnitInterval)

// Every option of the ops, group by group, in the schema's order: both maps before the groups with
// defaults.
#define FRL_VOCAB_DIVERGENCE_OP_OPTIONS(X) \
  FRL_LOGIT_MAP(X) FRL_TEACHER_LOGIT_MAP(X) FRL_VOCAB_SHARD(X) FRL_TILING(X) FRL_VOCAB_DIVERGENCE_OPTIONS(X)

namespace fused_rl_ops::vocab_divergence {

struct Options {
  FRL_VOCAB_DIVERGENCE_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_VOCAB_DIVERGENCE_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::vocab_divergence
