// vocab_divergence's own options, after the groups every vocab-parallel op takes (vocab_parallel/options.h:
// the student's map, the teacher's being the same with teacher_softcap), declared once
// (how: common/options.h; what each means: docs/vocab_divergence.md, "The ops underneath"). Python
// declares them as VocabDivergenceOptions (fused_rl_ops/vocab_divergence.py).
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

#define FRL_VOCAB_DIVERGENCE_OPTIONS(X)                           \
  X(int64_t, kind, "int", "=0", DivergenceKind)                   \
  X(std::optional<double>, teacher_softcap, "float?", "=None", PositiveFinite) \
  X(double, beta, "float", "=0.5", OpenUnitInterval)

// Every option of the ops, group by group, in the schema's order.
#define FRL_VOCAB_DIVERGENCE_OP_OPTIONS(X) FRL_VOCAB_PARALLEL_OPTIONS(X) FRL_VOCAB_DIVERGENCE_OPTIONS(X)

namespace fused_rl_ops::vocab_divergence {

struct Options {
  FRL_VOCAB_DIVERGENCE_OPTIONS(FRL_OPTION_FIELD)
};

template <class Fn>
void visit_options(const Options& options, const Fn& fn) {
  FRL_VOCAB_DIVERGENCE_OPTIONS(FRL_OPTION_VISIT)
}

}  // namespace fused_rl_ops::vocab_divergence
